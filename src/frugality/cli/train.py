"""`frugality train`."""

from __future__ import annotations

import sys

import click


@click.command()
@click.argument("recipe", required=False)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe field, e.g. --set optim.lr=3e-4 (repeatable).",
)
@click.option(
    "--run-dir",
    type=click.Path(),
    help="Run directory [default: the run whose recipe.toml RECIPE is, else <train.runs_dir>/<name>].",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Start over even if the run directory holds a checkpoint (the old run is moved aside).",
)
@click.option("--until-step", type=int, help="Stop (with a checkpoint) after this step; rerun to continue.")
@click.option(
    "--init-from",
    type=click.Path(),
    help="Start a new run from these weights: a run directory, a checkpoint, or a folder "
    "from `frugality import hf` or Hugging Face.",
)
@click.option(
    "--resume-optimizer", is_flag=True, help="With --init-from a frugality checkpoint: take its optimizer state too."
)
@click.option("--no-progress", is_flag=True, help="No progress bar (logs still go to the run directory).")
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes on this machine (started through torchrun's launcher; parallel.* in the recipe).",
)
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    help="Rerun a crashed run from its latest valid checkpoint up to this many times [default: train.retries].",
)
def train(
    recipe, overrides, run_dir, fresh, until_step, init_from, resume_optimizer, no_progress, nproc, retries
) -> None:
    """Train a model from RECIPE: a shipped recipe's name (default: tiny) or a .toml file.

    A run directory that holds a checkpoint resumes from it. Ctrl-C or SIGTERM finishes
    the current step, saves a checkpoint and exits; running the same command again
    continues where it stopped.
    """
    from frugality import distributed
    from frugality.config.recipe import load_recipe
    from frugality.training.trainer import train as run_training

    distributed.follow_launcher()  # a rank of --nproc N: end with the launcher
    resolved = load_recipe(recipe, list(overrides))
    if run_dir is None and recipe is not None:  # a run's own recipe file trains that run
        from frugality.training.run_dir import run_of_recipe_file

        own = run_of_recipe_file(recipe)
        run_dir = str(own) if own is not None else None
    from pathlib import Path

    from frugality.training.run_dir import check_run_dir

    where = Path(run_dir) if run_dir else Path(resolved.train.runs_dir) / resolved.name
    if not distributed.world_from_env().distributed:  # (a rank: its launcher checked)
        check_run_dir(where, fresh)  # before any process starts or anything is written
    if nproc > 1:  # what would stop every rank is said once, here, before any starts
        from frugality.runtime.layout import check_ranks

        check_ranks(resolved, nproc, resume_optimizer)
    # The command as given, for the processes that run it again: a later option wins over an
    # earlier one, so each adds only what differs for it.
    argv = click.get_current_context().find_root().obj["argv"]
    retries = resolved.train.retries if retries is None else retries
    if retries > 0:  # this process supervises; each attempt is the same command in a child
        from frugality.training.supervisor import supervise

        child = [sys.executable, "-m", "frugality", *argv, "--retries", "0"]
        sys.exit(supervise(child, where, retries, resolved.train.retry_backoff_s, log=click.echo))
    if nproc > 1:  # the same command in N processes, started as torchrun starts them
        sys.exit(
            distributed.launch_local(nproc, [*argv, "--nproc", "1", "--retries", "0"], resolved.parallel.timeout_s)
        )
    try:
        result = run_training(
            resolved,
            run_dir=run_dir,
            fresh=fresh,
            until_step=until_step,
            progress=not no_progress,
            init_from=init_from,
            resume_optimizer=resume_optimizer,
        )
    finally:
        distributed.shutdown()
    s = result.summary
    if result.complete and distributed.world_from_env().is_main:
        if until_step is not None and until_step < resolved.train.steps:
            click.echo(
                f"{result.run_dir}: already at step {until_step} (--until-step); nothing to do (a later "
                "--until-step, or none, trains on)"
            )
        else:
            click.echo(
                f"{result.run_dir}: complete at step {result.final_step}; nothing to do (raise train.steps "
                "to train on, or --fresh to start over)"
            )
        if not s:
            click.echo(f"{result.run_dir}: no summary.json (the session that finished ended before writing it)")
    if not s:  # a rank other than the first: rank 0 reports
        sys.exit(130 if result.interrupted else 0)
    click.echo(
        f"{result.run_dir}: step {s['final_step']}/{s['total_steps']}, "
        f"{s['tokens_seen']:,} tokens, {s['wall_time_s']:.0f} s; "
        f"val loss {_fmt(s['first_val_loss'])} -> {_fmt(s['final_val_loss'])}, "
        f"{_fmt(s.get('median_tokens_per_s'), '.0f')} tokens/s, MFU {_fmt(s.get('median_mfu'), '.1%')}"
        + _retrieval(s.get("final_eval_metrics") or {})
    )
    if "cost" in s:
        click.echo(cost_line(s["cost"]))
    if result.interrupted:
        sys.exit(130)


def _retrieval(metrics: dict) -> str:
    """A contrastive run's held-out retrieval figures, for the closing line."""
    shown = [f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith(("recall@", "mrr")) and v is not None]
    return ("; " + ", ".join(shown)) if shown else ""


def cost_line(c: dict) -> str:
    """The run's cost in one line, each figure's kind in brackets."""
    kind = lambda label: label.split(" ", 1)[0].split(":", 1)[0]  # measured, estimated, declared, catalogue
    labels = c["labels"]
    money = (
        f"${c['usd']:.4f} [{kind(labels['price'])}], {_fmt(c['tokens_per_dollar'], ',')} tokens/$"
        if c.get("usd") is not None
        else "no price (set cost.instance or cost.price_per_hour)"
    )
    line = (
        f"cost: {money}; {c['kwh'] * 1000:.3f} Wh [{kind(labels['energy'])}], "
        f"{_fmt(c['joules_per_token'], '.4g')} J/token, {c['kg_co2e'] * 1000:.3f} g CO2e"
    )
    target = c.get("target")
    if target:
        line += (
            f"; loss {target['loss']:g} reached at step {target['step']:g} after {target['elapsed_s']:.0f} s"
            if target["reached"]
            else f"; loss {target['loss']:g} not reached"
        )
    return line + " (summary.json says how each is known)"


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)

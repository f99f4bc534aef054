"""`frugality report RUN...` and `frugality compare RUN_A RUN_B`."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--out",
    type=click.Path(),
    help="Folder for report.md and the plots [default: RUN/report for one run, ./report for several].",
)
def report(runs, out) -> None:
    """Markdown and PNG plots of one or many runs side by side: the loss against steps,
    tokens, hours, dollars and kWh; throughput and MFU over time; what each run cost."""
    from frugality.errors import UserError
    from frugality.metrics.report import write_report

    for run in runs:
        if not (Path(run) / "metrics.jsonl").is_file():
            raise UserError(f"{run}: not a run directory (no metrics.jsonl)")
    out = Path(out) if out else (Path(runs[0]) / "report" if len(runs) == 1 else Path("report"))
    for path in write_report(list(runs), out):
        click.echo(str(path))


@click.command()
@click.argument("run_a", type=click.Path())
@click.argument("run_b", type=click.Path())
@click.option(
    "--tolerance",
    default="0.1%",
    show_default=True,
    help="The largest relative difference of the final validation loss that passes.",
)
@click.option("--plots", type=click.Path(), help="Also write the two runs' curves overlaid to this folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict and its figures as one JSON object.")
def compare(run_a, run_b, tolerance, plots, as_json) -> None:
    """Quality parity of two runs: PASS (exit 0) when B's final validation loss lies
    within the tolerance of A's, else FAIL (exit 1); where their training loss and
    gradient-norm curves part most; their cost and energy side by side."""
    from frugality.metrics.compare import load_trajectory, parity, parse_tolerance

    result = parity(run_a, run_b, parse_tolerance(tolerance))
    if plots:
        from frugality.metrics.report import plot_comparison

        result["plot"] = str(
            plot_comparison(
                load_trajectory(run_a),
                load_trajectory(run_b),
                (Path(run_a).name, Path(run_b).name),
                Path(plots) / "compare.png",
            )
        )
    if as_json:
        click.echo(json.dumps(result))
    else:
        a, b = (f"{v:.6f}" if isinstance(v, (int, float)) else str(v) for v in result["final_val_loss"])
        diff = result["final_val_rel_diff"]
        click.echo(
            f"{result['verdict']}: final validation loss at step {result['final_step']}: {a} (A) vs {b} (B), "
            f"{'not a number' if diff is None else format(diff, '+.4%')} (tolerance {result['tolerance']:.4%})"
        )
        click.echo(
            f"training loss over {result['train_steps_compared']} shared steps: largest deviation "
            f"{result['train_loss_max_rel_dev']:.4%}" + _at(result["train_loss_max_rel_dev_step"])
        )
        click.echo(
            f"gradient norm: largest deviation {result['grad_norm_max_rel_dev']:.4%}"
            + _at(result["grad_norm_max_rel_dev_step"])
        )
        for key, (x, y) in result["cost"].items():
            if x is not None or y is not None:
                click.echo(f"{key}: {_show(x)} (A) vs {_show(y)} (B)")
        for run, labels in zip("AB", result["cost_labels"], strict=True):
            known = "; ".join(f"{k} {v.split(' (')[0]}" for k, v in labels.items() if v)
            if known:
                click.echo(f"{run}'s figures: {known} (summary.json says how)")
        if plots:
            click.echo(f"plot: {result['plot']}")
    raise click.exceptions.Exit(0 if result["verdict"] == "PASS" else 1)


def _at(step) -> str:
    return f" at step {step}" if step is not None else ""


def _show(value) -> str:
    return "n/a" if value is None else f"{value:,}" if isinstance(value, int) else f"{value:.6g}"

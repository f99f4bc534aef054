"""`frugality ls` (the devices) and `frugality top` (what they and the runs are doing)."""

from __future__ import annotations

import json
import select
import sys
import time
from pathlib import Path

import click


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON list of the devices.")
def ls(as_json) -> None:
    """The devices of this machine: CPUs with their cores, instruction sets and memory;
    GPUs with their memory, driver, compute capability and power limit; XLA devices (with
    PJRT_DEVICE set, in .venv-xla) with their client."""
    from frugality.metrics.devices import inventory

    devices = inventory()
    if as_json:
        click.echo(json.dumps(devices))
        return
    for d in devices:
        if d["kind"] == "cpu":
            click.echo(
                f"cpu    {d['name']}: {d['usable_cpus']} of {d['logical_cpus']} logical CPUs usable, "
                f"{', '.join(d['instruction_sets']) or 'no vector extensions found'}; "
                f"bf16 {'native' if d['native_bf16'] else 'not native'}; {_gib(d['memory_gib'])} memory"
            )
        elif d["kind"] == "xla":
            version = f", torch-xla {d['torch_xla']}" if d["torch_xla"] else ""
            click.echo(f"xla{d['index']}   {d['name']}{version}")
        else:
            limit = f", power limit {d['power_limit_w']:.0f} W" if d["power_limit_w"] else ""
            click.echo(
                f"gpu{d['index']}   {d['name']}: {_gib(d['memory_gib'])}, compute capability "
                f"{d['compute_capability']}, driver {d['driver']}{limit}"
            )


@click.command()
@click.option(
    "--runs",
    "runs_dir",
    default="runs",
    show_default=True,
    type=click.Path(),
    help="Where to look for running jobs (a runs folder or one run directory).",
)
@click.option(
    "--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds between refreshes."
)
@click.option("--once", is_flag=True, help="Measure over one interval, print, and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once: one JSON object.")
def top(runs_dir, interval, once, as_json) -> None:
    """Live: each device's utilisation, memory and power (where measurable), and the
    runs training under --runs with their step, tokens/s and ETA. q or Ctrl-C quits."""
    from frugality.errors import UserError
    from frugality.metrics.devices import Sampler
    from frugality.training.run_dir import active_runs

    if as_json and not once:
        raise UserError("--json needs --once (a live view is for people; scripts take one sample)")
    sampler = Sampler()
    if once:
        time.sleep(interval)  # utilisation and power are rates: measured over an interval
        snapshot = {"devices": sampler.sample(), "runs": active_runs(Path(runs_dir))}
        click.echo(json.dumps(snapshot) if as_json else "\n".join(_lines(snapshot)))
        return
    from rich.live import Live
    from rich.text import Text

    with _keys() as pressed, Live(Text("measuring..."), auto_refresh=False, transient=False) as live:
        try:
            while not pressed(interval):
                snapshot = {"devices": sampler.sample(), "runs": active_runs(Path(runs_dir))}
                live.update(Text("\n".join(_lines(snapshot)) + "\n(q quits)"), refresh=True)
        except KeyboardInterrupt:
            pass


def _lines(snapshot: dict) -> list[str]:
    lines = [f"{'device':8} {'util':>6} {'memory':>17} {'power':>9}"]
    for d in snapshot["devices"]:
        name = "cpu" if d["kind"] == "cpu" else f"gpu{d['index']}"
        util = "n/a" if d["utilisation"] is None else f"{d['utilisation']:.0%}"
        memory = (
            f"{d['memory_used_gib']:.1f}/{d['memory_gib']:.1f} GiB"
            if d["memory_used_gib"] is not None and d["memory_gib"]
            else "n/a"
        )
        power = "n/a" if d["power_w"] is None else f"{d['power_w']:.0f} W"
        lines.append(f"{name:8} {util:>6} {memory:>17} {power:>9}")
    lines.append("")
    if not snapshot["runs"]:
        lines.append("no run training under the runs folder")
    for r in snapshot["runs"]:
        if r.get("serving"):
            rate = "n/a" if r.get("requests_per_s") is None else f"{r['requests_per_s']:,.1f} requests/s"
            lines.append(
                f"{r['run_dir']} (PID {r['pid']}): serving {r['serving']}, {rate}, {r.get('requests', 0):,} in all"
            )
            continue
        step = f"step {r['step']}/{r['total_steps']}" if r["step"] is not None else "starting"
        speed = f", {r['tokens_per_s']:,.0f} tokens/s" if r["tokens_per_s"] else ""
        eta = f", ETA {_duration(r['eta_s'])}" if r["eta_s"] is not None else ""
        lines.append(f"{r['run_dir']} (PID {r['pid']}): {step}{speed}{eta}")
    return lines


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _gib(value) -> str:
    return "n/a" if value is None else f"{value:.1f} GiB"


class _keys:
    """The terminal in cbreak mode (keys arrive unbuffered, unechoed) while `top` runs;
    `pressed(timeout)` waits up to `timeout` and says whether q was pressed."""

    def __enter__(self):
        self.saved = None
        if sys.stdin.isatty():
            import termios
            import tty

            self.saved = termios.tcgetattr(sys.stdin)
            tty.setcbreak(sys.stdin)
        return self.pressed

    def pressed(self, timeout: float) -> bool:
        if self.saved is None:
            time.sleep(timeout)
            return False
        ready, _, _ = select.select([sys.stdin], [], [], timeout)
        return bool(ready) and sys.stdin.read(1).lower() == "q"

    def __exit__(self, *exc):
        if self.saved is not None:
            import termios

            termios.tcsetattr(sys.stdin, termios.TCSADRAIN, self.saved)
        return False

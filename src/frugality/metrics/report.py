"""`frugality report`: one or many runs side by side, as Markdown (`report.md`) and PNG
plots: the loss against steps, tokens, hours, dollars and kWh (`loss.png`), throughput
and MFU over time (`throughput.png`), the training loss and gradient norm of two compared
runs overlaid (`compare.png`). Matplotlib draws them off-screen (the Agg backend)."""

from __future__ import annotations

from pathlib import Path

from frugality.metrics.compare import Trajectory, load_trajectory
from frugality.paths import write_atomically

# The x axes of loss.png: (title, the train/eval record's field, scale to the unit shown)
AXES = (
    ("step", "step", 1.0),
    ("tokens (millions)", "tokens", 1e-6),
    ("hours", "elapsed_s", 1 / 3600),
    ("dollars", "usd", 1.0),
    ("device kWh (before PUE)", "energy_j", 1 / 3.6e6),
)


def write_report(runs: list[str | Path], out: str | Path, names: list[str] | None = None) -> list[Path]:
    """Write report.md, loss.png and throughput.png for `runs` into `out`; the paths written."""
    out = Path(out)
    trajectories = [load_trajectory(r) for r in runs]
    names = names or _names([Path(r) for r in runs])
    out.mkdir(parents=True, exist_ok=True)
    written = [
        _plot_loss(trajectories, names, out / "loss.png"),
        _plot_throughput(trajectories, names, out / "throughput.png"),
    ]
    write_atomically(out / "report.md", _markdown(trajectories, names, [p.name for p in written]))
    return [out / "report.md", *written]


def _names(paths: list[Path]) -> list[str]:
    names = [p.name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _series(records: dict[int, dict], key: str, scale: float, y: str = "loss"):
    xs, ys = [], []
    for step in sorted(records):
        r = records[step]
        x = step if key == "step" else r.get(key)
        if isinstance(x, (int, float)) and isinstance(r.get(y), (int, float)):
            xs.append(x * scale)
            ys.append(r[y])
    return xs, ys


def _plot_loss(trajectories: list[Trajectory], names: list[str], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(AXES), figsize=(4 * len(AXES), 3.6), constrained_layout=True)
    for ax, (title, key, scale) in zip(axes, AXES, strict=True):
        for t, name in zip(trajectories, names, strict=True):
            train = t.train
            if key == "energy_j":  # energy is known at evaluations only (the ranks meet there)
                train = {}
            ax.plot(*_series(train, key, scale), label=f"{name} train", alpha=0.6, linewidth=1)
            ax.plot(*_series(t.eval, key, scale), marker="o", markersize=3, label=f"{name} validation")
        ax.set_xlabel(title)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_throughput(trajectories: list[Trajectory], names: list[str], path: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    for t, name in zip(trajectories, names, strict=True):
        left.plot(*_series(t.train, "elapsed_s", 1 / 3600, "tokens_per_s"), label=name)
        right.plot(*_series(t.train, "elapsed_s", 1 / 3600, "mfu"), label=name)
    for ax, label in ((left, "tokens/s"), (right, "MFU")):
        ax.set_xlabel("hours")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(a: Trajectory, b: Trajectory, names: tuple[str, str], path: Path) -> Path:
    """Two runs' training loss and gradient norm, step by step, overlaid."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    for t, name in zip((a, b), names, strict=True):
        left.plot(*_series(t.train, "step", 1.0, "loss"), label=name, alpha=0.8)
        right.plot(*_series(t.train, "step", 1.0, "grad_norm"), label=name, alpha=0.8)
    for ax, label in ((left, "training loss"), (right, "gradient norm")):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ROWS = (  # (heading, where in summary.json, format)
    ("final step", ("final_step",), "{}"),
    ("device", ("device",), "{}"),
    ("precision", ("precision",), "{}"),
    ("final validation loss", ("final_val_loss",), "{:.4f}"),
    ("tokens", ("cost", "tokens"), "{:,}"),
    ("wall time (run, s)", ("cost", "wall_time_s"), "{:,.1f}"),
    ("tokens/s (run average)", ("cost", "tokens_per_s"), "{:,.0f}"),
    ("median tokens/s", ("median_tokens_per_s",), "{:,.0f}"),
    ("median MFU", ("median_mfu",), "{:.1%}"),
    ("dollars", ("cost", "usd"), "${:,.4f}"),
    ("tokens per dollar", ("cost", "tokens_per_dollar"), "{:,}"),
    ("$ per million tokens", ("cost", "usd_per_million_tokens"), "${:,.4f}"),
    ("kWh", ("cost", "kwh"), "{:.6f}"),
    ("J per token", ("cost", "joules_per_token"), "{:.4f}"),
    ("kg CO2e", ("cost", "kg_co2e"), "{:.6f}"),
)


def _get(summary: dict, keys: tuple[str, ...]):
    value = summary
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _markdown(trajectories: list[Trajectory], names: list[str], images: list[str]) -> str:
    lines = ["# Runs", "", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for heading, keys, spec in ROWS:
        cells = []
        for t in trajectories:
            value = _get(t.summary, keys)
            cells.append("n/a" if value is None else spec.format(value))
        lines.append(f"| {heading} | " + " | ".join(cells) + " |")
    lines += ["", "How each figure is known:", ""]
    for t, name in zip(trajectories, names, strict=True):
        labels = _get(t.summary, ("cost", "labels")) or {}
        if not labels:
            lines.append(f"- {name}: no cost figures (a run without a summary, or from before they existed)")
        for key, text in labels.items():
            lines.append(f"- {name}, {key.replace('_', ' ')}: {text}")
        target = _get(t.summary, ("cost", "target"))
        if target:
            lines.append(
                f"- {name}, target loss {target['loss']:g}: "
                + (
                    f"reached at step {target['step']:g} after {target['elapsed_s']:,.1f} s, "
                    f"{target['kwh']:.6f} kWh" + (f", ${target['usd']:,.4f}" if target.get("usd") is not None else "")
                    if target["reached"]
                    else "not reached"
                )
            )
    lines += ["", *(f"![{Path(i).stem}]({i})" for i in images), ""]
    return "\n".join(lines)

"""``unirl plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--metrics reward/mean,eval/accuracy,...]``.

One PNG with a panel per metric and every run overlaid under its name. Training rows of
``metrics.jsonl`` are drawn as lines over ``step``; evaluation rows (the ones holding ``eval/*``
keys) as points, so a handful of evaluations stay visible next to hundreds of training steps.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

#: Panels drawn when ``--metrics`` is not given: those that at least one run logged, less those whose
#: values never change (``actor/clip_frac`` 0 throughout an on-policy run), which are named on stderr.
DEFAULT_METRICS = (
    "reward/mean", "eval/accuracy", "eval/reward", "loss/kl", "actor/entropy", "actor/clip_frac",
    "rollout/response_length_mean", "actor/grad_norm",
    # Diffusion's off-target figures (unirl/diffusion/offtarget.py): what moves when the reward is hacked.
    "offtarget/eval/reward", "offtarget/brightness", "offtarget/dark_frac", "offtarget/blown_frac",
    "offtarget/diversity",
)
#: Logged metrics with these prefixes are drawn too: each off-target reward a run names.
DEFAULT_PREFIXES = ("offtarget/eval/reward/",)
#: Figures of evaluation rows, drawn as points.
EVALUATION_PREFIXES = ("eval/", "offtarget/eval/")


class PlotError(ValueError):
    """A run directory or a metric the user named is not there; the message says which."""


def read_rows(run_dir: Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl``; a missing file or a bad line is a ``PlotError``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl there (expected a run directory made by unirl train)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlotError(f"{path}: not a text file (byte {e.start} is not UTF-8); expected one JSON object a line") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise PlotError(f"{path}:{number}: not a JSON object (a {type(row).__name__})")
            rows.append(row)
    return rows


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, with its parent's in front when two names would clash."""
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{Path(d).resolve().parent.name}/{Path(d).resolve().name}" for d in run_dirs]


def series(rows: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of a metric, skipping rows without it and non-finite values."""
    steps, values = [], []
    for row in rows:
        value = row.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def default_panels(runs: dict[str, list[dict]], logged: set[str]) -> list[str]:
    """The default metrics the runs logged, without those that hold one value throughout every run (said
    on stderr); all of them when every one is constant, so a plot is never empty."""
    panels = [m for m in DEFAULT_METRICS if m in logged]
    panels += sorted(m for m in logged if m.startswith(DEFAULT_PREFIXES))
    if not panels:
        raise PlotError("these runs logged none of the default metrics; name some with --metrics")
    values = {m: {v for rows in runs.values() for v in series(rows, m)[1]} for m in panels}
    # A run's single evaluation is a point, not a flat line: a panel goes only when some run logged it twice.
    repeated = {m: max(len(series(rows, m)[1]) for rows in runs.values()) > 1 for m in panels}
    constant = [m for m in panels if repeated[m] and len(values[m]) == 1]
    if constant and len(constant) < len(panels):
        said = ", ".join(f"{m} (always {next(iter(values[m])):g})" for m in constant)
        print(f"unirl plot: left out {said}: the value never changes; --metrics draws it", file=sys.stderr)
        panels = [m for m in panels if m not in constant]
    return panels


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None, metrics: list[str] | None = None) -> Path:
    """Draw the runs' metrics into one PNG; returns its path (default ``<first run>/curves.png``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise PlotError("name at least one run directory")
    runs = {name: read_rows(Path(d)) for name, d in zip(run_names([Path(d) for d in run_dirs]), run_dirs)}
    logged = {key for rows in runs.values() for row in rows for key in row}
    if metrics:
        missing = [m for m in metrics if m not in logged]
        if missing:
            available = ", ".join(sorted(k for k in logged if k != "step"))
            raise PlotError(f"--metrics: {', '.join(missing)} not logged by these runs; logged: {available}")
        panels = list(metrics)
    else:
        panels = default_panels(runs, logged)
    columns = min(2, len(panels))
    rows_n = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(6 * columns, 3.6 * rows_n), squeeze=False)
    for ax, metric in zip(axes.flat, panels):
        for index, (name, rows) in enumerate(runs.items()):
            colour = f"C{index % 10}"
            steps, values = series(rows, metric)
            if metric.startswith(EVALUATION_PREFIXES):
                ax.plot(steps, values, "o--", color=colour, label=name, markersize=5, linewidth=0.8)
            else:
                ax.plot(steps, values, "-", color=colour, label=name, linewidth=1.2)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

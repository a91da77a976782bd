"""Loss curves of one or more runs (DiLoCo, DDP, one worker) in one picture, against step, bytes sent or
training time: train loss (smoothed) and eval loss, a DDP warm start shaded, each round's agreement of the
workers' pseudo-gradients and, for peers that come and go, its contributors."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .metrics import read_metrics
from .plot_data import AXES, RunCurves, read_run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "X_CHOICES",
    "draw_runs",
    "plot_runs",
    "read_metrics",
]  # read_metrics: bench/convergence.py's import

logger = logging.getLogger(__name__)

X_CHOICES = (*AXES, "all")
"""``diloco plot --x``: one of the axes, or all three side by side."""

_XLABELS = {
    "step": "step (per worker)",
    "bytes": "MB sent by rank 0 (cumulative)",
    "time": "training seconds (rank 0, evals left out)",
}
_SCALE = {"step": 1.0, "bytes": 1e-6, "time": 1.0}  # bytes are drawn in MB


def _smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    out, ema = [], None
    for v in values:
        ema = v if ema is None else (1 - alpha) * ema + alpha * v
        out.append(ema)
    return out


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, x: str = "step") -> Path:
    """Overlay the runs' loss curves against ``x`` (one of ``X_CHOICES``) into the PNG ``out``."""
    if x not in X_CHOICES:
        raise ValueError(f"x={x!r} is invalid: expected one of {', '.join(X_CHOICES)}")
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also safe from worker threads
    import matplotlib.pyplot as plt

    fig = draw_runs([read_run(d) for d in run_dirs], axes=AXES if x == "all" else (x,))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("plot written to %s", out)
    return out


def draw_runs(runs: Sequence[RunCurves], *, axes: Sequence[str]) -> Figure:
    """A figure with a column per x axis: loss on top; below it, where runs have outer rounds, each round's
    agreement; and where a run's peers come and go (hivemind, or a varying group), each round's contributors."""
    import matplotlib.pyplot as plt

    panels = ["loss"]
    if any(r.rounds for r in runs):
        panels.append("agreement")
    if any(r.rounds and (r.transport == "hivemind" or r.contributors_vary) for r in runs):
        panels.append("contributors")
    heights = {"loss": 3.0, "agreement": 1.0, "contributors": 1.0}
    fig, grid = plt.subplots(
        len(panels),
        len(axes),
        figsize=(6 * len(axes) + 3 * (len(axes) == 1), 4 + 1.5 * (len(panels) - 1)),
        sharex="col",
        squeeze=False,
        height_ratios=[heights[p] for p in panels],
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, axis in enumerate(axes):
        log = axis == "bytes" and _spread(runs) > 20  # DDP sends hundreds of times DiLoCo's bytes
        for i, run in enumerate(runs):
            color = colors[i % len(colors)]
            for row, panel in enumerate(panels):
                _draw(
                    grid[row][col],
                    panel=panel,
                    run=run,
                    axis=axis,
                    color=color,
                    log=log,
                    alone=len(runs) == 1,
                )
        for row, panel in enumerate(panels):
            ax = grid[row][col]
            ax.grid(alpha=0.3)
            if log:
                ax.set_xscale("log")
            ax.set_ylabel(_YLABELS[panel])
        _legend(grid[0][col], shown=grid[0][0] if col else None)
        grid[-1][col].set_xlabel(_XLABELS[axis])
        if "agreement" in panels:
            grid[panels.index("agreement")][col].set_ylim(0, 1.05)
    fig.suptitle(", ".join(r.name for r in runs))
    fig.tight_layout()
    return fig


_YLABELS = {
    "loss": "loss (nats/token)",
    "agreement": "agreement\n(1: workers agree)",
    "contributors": "contributors\nper round",
}


def _legend(ax: Any, *, shown: Any) -> None:
    """The loss panel's legend; beside the first column's, only the labels that one lacks (a single run's
    line on the bytes axis)."""
    handles, labels = ax.get_legend_handles_labels()
    known = set(shown.get_legend_handles_labels()[1]) if shown is not None else set()
    new = [(h, label) for h, label in zip(handles, labels) if label not in known]
    if new:
        ax.legend(*zip(*new), fontsize="small")


def _spread(runs: Sequence[RunCurves]) -> float:
    sent = [r.bytes_sent for r in runs if r.bytes_sent > 0]
    return max(sent) / min(sent) if sent else 1.0


def _draw(
    ax: Any, *, panel: str, run: RunCurves, axis: str, color: str, log: bool, alone: bool
) -> None:
    """One run's curves in one panel against ``axis``."""
    scale = _SCALE[axis]

    def xy(steps: list[int], ys: list[float]) -> tuple[list[float], list[float]]:
        points = [(x * scale, y) for x, y in zip(run.x(axis, steps), ys) if x > 0 or not log]
        return [p[0] for p in points], [p[1] for p in points]

    if axis == "bytes" and run.bytes_sent == 0:  # one worker, or a peer alone: nothing on the wire
        if panel == "loss" and run.evals:
            ax.axhline(
                run.evals[-1][1],
                color=color,
                ls=":",
                label=f"{run.name} final eval (sends nothing)",
            )
        return
    if panel == "loss":
        if run.warm_start:
            left, right = run.x(axis, [1 if log else 0, run.warm_start])
            label = f"{run.name} DDP warm start ({run.warm_start} steps)"
            ax.axvspan(left * scale, right * scale, color=color, alpha=0.12, lw=0, label=label)
        steps = [s for s, _ in run.train]
        ax.plot(
            *xy(steps, _smooth([v for _, v in run.train])),
            color=color,
            alpha=0.6,
            label=f"{run.name} train (EMA)",
        )
        if run.evals:
            evals = xy([s for s, _ in run.evals], [v for _, v in run.evals])
            ax.plot(*evals, "o-", color=color, ms=4, label=f"{run.name} eval")
        if alone and len(run.rounds) <= 30:  # more would hide the curves
            ends, _ = xy([r["step"] for r in run.rounds], [0.0] * len(run.rounds))
            for j, x in enumerate(ends):
                ax.axvline(
                    x, color="gray", lw=0.6, ls="--", label="outer round" if j == 0 else None
                )
    elif panel == "agreement" and run.rounds:
        points = xy([r["step"] for r in run.rounds], [r["agreement"] for r in run.rounds])
        ax.plot(*points, ".-", color=color, ms=3, label=run.name)
    elif panel == "contributors" and run.rounds:
        points = xy([r["step"] for r in run.rounds], [r["num_contributors"] for r in run.rounds])
        ax.plot(*points, "o-", color=color, ms=3, drawstyle="steps-post", lw=0.8, label=run.name)
        ax.set_ylim(bottom=0)
        ax.yaxis.get_major_locator().set_params(integer=True)

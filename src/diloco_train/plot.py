"""Loss curves from runs' metrics.jsonl: train loss (smoothed) and eval loss vs step, rounds as vertical lines."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from .metrics import read_metrics

__all__ = ["plot_runs", "read_metrics"]  # read_metrics: also imported from here (bench/convergence.py)

logger = logging.getLogger(__name__)


def _smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    out, ema = [], None
    for v in values:
        ema = v if ema is None else (1 - alpha) * ema + alpha * v
        out.append(ema)
    return out


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Overlay the runs' loss curves into the PNG ``out``; round boundaries are drawn for a single run."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also safe from worker threads
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    with_rounds = any(r.get("type") == "round" for _, records in runs for r in records)
    if with_rounds:  # DiLoCo runs: a second panel with each round's agreement of the workers' pseudo-gradients
        fig, (ax, ax_agree) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 1))
    else:
        fig, ax = plt.subplots(figsize=(9, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (run_dir, records) in enumerate(runs):
        color = colors[i % len(colors)]
        steps = [r for r in records if r.get("type") == "step"]
        evals = [r for r in records if r.get("type") == "eval"]
        rounds = [r for r in records if r.get("type") == "round"]
        if steps:
            ax.plot(
                [r["step"] for r in steps],
                _smooth([r["loss"] for r in steps]),
                color=color,
                alpha=0.6,
                label=f"{run_dir.name} train (EMA)",
            )
        if evals:
            eval_loss = [r["loss"] for r in evals]
            ax.plot([r["step"] for r in evals], eval_loss, "o-", color=color, label=f"{run_dir.name} eval")
        if len(runs) == 1 and len(rounds) <= 30:  # more would hide the curves
            for j, r in enumerate(rounds):
                ax.axvline(r["step"], color="gray", lw=0.6, ls="--", label="outer round" if j == 0 else None)
        if rounds:
            agreement = [r["agreement"] for r in rounds]
            ax_agree.plot([r["step"] for r in rounds], agreement, ".-", color=color, ms=3, label=run_dir.name)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(", ".join(d.name for d, _ in runs))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if with_rounds:
        ax_agree.set_ylabel("agreement")
        ax_agree.set_ylim(0, 1.05)
        ax_agree.set_title(
            "|mean pseudo-gradient| / mean |pseudo-gradient| per round (1: workers agree)", fontsize="small"
        )
        ax_agree.grid(alpha=0.3)
        ax_agree.set_xlabel("step (per worker)")
    else:
        ax.set_xlabel("step (per worker)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("plot written to %s", out)
    return out

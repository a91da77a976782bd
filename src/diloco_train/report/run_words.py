"""What a run says of itself on the terminal: its header (what it will do) and its summary (what it did)."""

from __future__ import annotations

import math
from pathlib import Path

from diloco_core import FP32, DiLoCoConfig
from diloco_core.codecs.names import codec_of

from ..layout import describe_workers
from ..modes import warm_start_steps
from ..run_config import RunConfig
from .metrics import TrainResult, perplexity

__all__ = ["run_header", "run_summary", "traffic_line"]


def run_header(config: RunConfig, run_dir: Path, *, fixed_ranks: bool) -> str:
    """The run's first line: its mode, workers, model, steps, rounds and DDP warm start."""
    t = config.train
    line = f"run {run_dir}: {t.mode}, {describe_workers(config)}, model {config.model.preset}, {t.steps} steps"
    if t.mode != "diloco":
        return line
    return (
        line
        + f", {_rounds(config.diloco)}"
        + _warm_start(warm_start_steps(config, fixed_ranks=fixed_ranks))
    )


def _warm_start(warm: int) -> str:
    if not warm:
        return ""
    steps = f"{warm} steps" if warm > 1 else "step"
    return f"; its first {steps} DDP (a warm start: gradients all-reduced every step, train.ddp_warm_start)"


def _rounds(c: DiLoCoConfig) -> str:
    """When the run's outer rounds come, in words."""
    if c.round_seconds is None:
        return f"outer round every {c.inner_steps}"
    return f"outer rounds of {c.round_seconds:g}s (elastic: {c.inner_steps} steps a round's work)"


def run_summary(result: TrainResult, run_dir: Path) -> str:
    """The run's losses, wall time, the two busy figures (rank 0's compute, every worker's goodput) and files."""
    wall = result.wall_seconds
    util = result.compute_seconds / wall if wall else 0.0
    busy = (
        f", goodput {100 * result.goodput:.1f}% (all workers: busy / (workers x wall))"
        if result.goodput
        else ""
    )
    losses = (
        f"eval loss {result.eval_before:.4f} (perplexity {perplexity(result.eval_before):.2f}) -> "
        f"{result.eval_after:.4f} (perplexity {perplexity(result.eval_after):.2f}) after {result.steps} steps"
    )
    compute = (
        f"wall {wall:.1f}s, compute utilization {100 * util:.1f}% (rank 0: compute / wall){busy}, "
        f"{result.bytes_sent / 1e6:.1f} MB sent by rank 0"
    )
    lines = [
        losses,
        compute,
        f"files: {run_dir}/metrics.jsonl, config.toml, plot.png, checkpoints/",
    ]
    if not math.isfinite(result.eval_after):
        lines.append(
            "the eval loss is not finite: training diverged (states that were not finite were not checkpointed)"
        )
    return "\n".join(lines)


def traffic_line(result: TrainResult, config: RunConfig) -> str | None:
    """What DDP would have sent for the run's steps against what its rounds sent (None: no rounds)."""
    if not result.rounds:
        return None
    # DDP all-reduces the gradient, as many values as a round's pseudo-gradient, at every step, in fp32.
    codec = codec_of(config.diloco)
    # 1 << 20: whole codec blocks
    as_fp32 = FP32.payload_bytes(1 << 20) / codec.payload_bytes(1 << 20)
    ddp = result.round_bytes / result.rounds * as_fp32 * result.steps_run
    return (
        f"traffic: DDP would have sent ~{ddp / 1e6:,.0f} MB for these {result.steps_run} steps, "
        f"{ddp / max(result.bytes_sent, 1):.1f}x what DiLoCo sent ({result.rounds} rounds); compare the loss with "
        "--set train.mode=ddp and --set train.mode=single (docs/results.md)"
    )

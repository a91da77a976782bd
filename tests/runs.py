"""A short ``diloco train`` run in this process: its arguments, and what it wrote (the trainer's tests)."""

from __future__ import annotations

import json
from pathlib import Path

# A fast run: 2 workers, 1-layer tiny model, short windows, 12 steps with a round every 3.
FAST = [
    "--set",
    "train.workers=2",
    "--set",
    "train.steps=12",
    "--set",
    "diloco.inner_steps=3",
    "--set",
    "model.num_layers=1",
    "--set",
    "data.seq_len=32",
    "--set",
    "train.batch_size=4",
    "--set",
    "train.eval_batches=1",
    "--set",
    "train.warmup_steps=2",
    "--set",
    "train.checkpoint_every=1",
    "--set",
    "train.ddp_warm_start=0",  # rounds from step 0 (the default warm start, steps // 12: test_train_config.py)
    "-q",
]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "step"]


def check_interrupted_line(after: list[str], run: Path, *, resume: str, may_have_none: bool) -> None:
    """A run of processes stopped by Ctrl+C (no soft stop across processes): its one last line names its newest
    checkpoint with ``resume`` (the command's start) as the hint, or, with none written (only where
    ``may_have_none``), says that nothing can be resumed."""
    saved = sorted(int(p.name[4:12]) for p in (run / "checkpoints").glob("step*-rank0.pt"))
    assert saved or may_have_none
    if saved:
        assert len(after) == 1, after
        assert after[0].startswith(
            f"diloco: interrupted (SIGINT); newest checkpoint: step {saved[-1]} (resume with: {resume}"
        ), after
    else:
        assert after == ["diloco: interrupted (SIGINT) before the first checkpoint: nothing can be resumed"], after

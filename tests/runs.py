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

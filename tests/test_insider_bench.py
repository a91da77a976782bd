"""bench/insider.py in small: in-process workers, a few rounds, the insider left out of every one."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from insider import main

pytestmark = pytest.mark.timeout(600)


def test_every_insider_is_left_out_of_every_round_and_the_run_ends_as_the_honest_ones_alone(tmp_path, capsys):
    """Tiny runs (40 steps, H = 5, after a DDP warm start of 10): the 3-worker runs with an insider scaled by
    1e6, -1e6 and -10 leave it out of every round, so they end with the same eval loss, bit for bit."""
    sets = ["train.ddp_warm_start=10", "diloco.inner_steps=5", "train.eval_every=20", "train.eval_batches=2"]
    sets += ["model.num_layers=1", "data.seq_len=32", "train.batch_size=4"]  # a small model: seconds a run
    argv = ["--out", str(tmp_path), "--steps", "40", *[a for s in sets for a in ("--set", s)]]
    assert main(argv) == 0
    table = capsys.readouterr().out
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| inprocess")]
    assert [r[0] for r in rows] == [
        "| inprocess-robust-honest2",
        *(f"| inprocess-robust-insider{s}" for s in ("x1e6", "x-1e6", "x-10")),
    ]
    assert [r[3] for r in rows[1:]] == ["6/6"] * 3, table
    assert [r[4] for r in rows] == ["None", "1", "1", "1"], table  # named from the first round
    assert [r[5] for r in rows] == ["0/6 |"] * 4, table  # nobody missing from a round (no one benched in-process)
    assert len({r[1] for r in rows[1:]}) == 1, table  # the insider's scale changes nothing: it is left out
    records = [json.loads(line) for line in (tmp_path / "inprocess-robust-insiderx-10" / "metrics.jsonl").open()]
    left_out = [r["left_out"] for r in records if r["type"] == "round"]
    assert all(lo and lo[0]["who"] == "rank 2" and lo[0]["ratio"] > 3 for lo in left_out), left_out

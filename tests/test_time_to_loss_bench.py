"""The time-to-loss benchmark's arithmetic, on hand-written metrics.jsonl (the runs themselves:
bench/time_to_loss.py): training seconds leave the evals out, the target is the first eval at or below it,
and the prediction charges each sync what the link leaves unhidden."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from time_to_loss import METHODS, command, link_of, predict, read

from diloco_train.plan import Link, Method


def _write(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_training_seconds_leave_out_the_evals_and_the_target_is_the_first_eval_at_or_below_it(tmp_path: Path) -> None:
    _write(
        tmp_path / "r",
        [
            {"type": "eval", "step": 0, "loss": 5.0, "time_s": 0.0, "eval_s": 0.0},
            {"type": "eval", "step": 10, "loss": 3.0, "time_s": 11.0, "eval_s": 1.0},  # 10 s of steps, then 1 s
            {"type": "eval", "step": 20, "loss": 2.0, "time_s": 22.0, "eval_s": 1.0},
            {"type": "eval", "step": 30, "loss": 1.9, "time_s": 33.0, "eval_s": 1.0},
        ],
    )
    _, curve = read(tmp_path / "r")
    assert curve.steps == [10, 20, 30] and curve.seconds == pytest.approx([10.0, 20.0, 30.0])
    assert not curve.finished  # no summary and not stopped at a target
    assert curve.reach(2.0) == 1 and curve.reach(1.95) == 2 and curve.reach(1.0) is None


def test_the_prediction_charges_ddp_steps_fully_and_hides_rounds_as_the_mode_does() -> None:
    link = Link(mbit=100, shared=True)  # 1 MB from each of 2 workers: 0.16 s
    records = [
        {"type": "step", "step": s, "round": 0, "compute_s": 0.1, "bytes_sent": 1_000_000, "bytes_received": 1_000_000}
        for s in (1, 2)
    ]
    records += [
        {
            "type": "step",
            "step": s,
            "round": 1,
            "compute_s": 0.1,
            "bytes_sent": 0 if s < 12 else 1_000_000,
            "bytes_received": 0,
        }
        for s in range(3, 13)
    ]
    records.append(
        {
            "type": "round",
            "step": 12,
            "bytes_sent": 1_000_000,
            "bytes_received": 1_000_000,
            "round_s": 0.5,
            "comm_s": 0.45,
        }
    )
    steps = 12 * 0.1
    # blocking: 2 warm-start reduces, the round's, and the round's own 0.05 s outside its reduce
    assert predict(records, upto=12, method=Method("blocking", 10), link=link) == pytest.approx(steps + 3 * 0.16 + 0.05)
    assert predict(records, upto=12, method=Method("eager", 10), link=link) == pytest.approx(steps + 2 * 0.16)
    assert predict(records, upto=11, method=Method("blocking", 10), link=link) == pytest.approx(1.1 + 2 * 0.16)
    assert predict(records, upto=2, method=None, link=link) == pytest.approx(0.2 + 2 * 0.16)  # DDP: every step
    # a link of each worker's own (the simulated link, in-process workers) carries the busier direction
    own = Link(mbit=100)
    records[-1] |= {"bytes_received": 4_000_000}  # the round: 1 MB out, 4 MB in (0.32 s)
    assert predict(records, upto=12, method=Method("blocking", 10), link=own, workers=4) == pytest.approx(
        steps + 2 * 0.08 + 0.32 + 0.05
    )


def test_commands_put_the_run_on_its_link_and_ddp_runs_its_own_steps(tmp_path: Path) -> None:
    args = argparse.Namespace(out=tmp_path, simulated=False)
    cmd = command(name="x", method="eager-warm-fp32", link="100mbit", seed=1, steps=800, args=args)
    assert cmd[0].endswith("shaped_link.sh") and cmd[1] == "100mbit"
    sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
    assert {"train.seed=1", "train.steps=800", "diloco.overlap=eager", "train.ddp_wire_dtype=fp32"} <= set(sets)
    args.simulated = True
    cmd = command(name="x", method="ddp", link="1gbit", seed=0, steps=400, args=args)
    assert "shaped_link.sh" not in " ".join(cmd) and "transport.link_mbit=500" in cmd  # half: one queue, 2 workers
    assert "transport.link_mbit=" not in " ".join(
        command(name="x", method="ddp", link="free", seed=0, steps=4, args=args)
    )
    assert link_of("1gbit", simulated=True) == Link(mbit=500) and link_of("100mbit", simulated=False).shared
    assert set(METHODS) >= {"ddp", "diloco", "eager", "streaming-warm-fp32", "sign-warm-fp32"}

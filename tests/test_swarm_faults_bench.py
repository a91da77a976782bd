"""bench/swarm_faults.py's arithmetic and its seeded failure schedule, on hand-written records (the runs: the bench)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from swarm_faults import _schedule, goodput_of, round_times

pytestmark = pytest.mark.timeout(30)


def _records(rounds_at: dict[int, int], steps: int, compute: float = 0.5) -> list[dict]:
    """``steps`` steps of ``compute`` s each, 1 s apart; round r's record before step ``rounds_at[r]``."""
    out = []
    at = {s: r for r, s in rounds_at.items()}
    for s in range(1, steps + 1):
        if s in at:
            out.append({"type": "round", "round": at[s]})
        out.append({"type": "step", "step": s, "compute_s": compute, "time_s": float(s)})
    return out


def test_round_times_run_from_one_rounds_end_to_the_next():
    records = _records({1: 3, 2: 5, 3: 10}, steps=12)
    assert round_times(records) == [(2, 2.0), (3, 5.0)]


def test_goodput_counts_each_process_up_to_its_last_committed_round():
    done = _records({1: 3, 2: 5}, steps=5)  # all 5 steps up to the step that ended round 2
    killed = _records({1: 3}, steps=8)  # steps 4..8 after its last round are lost
    assert goodput_of([done, killed], workers=2, wall=10.0) == pytest.approx((5 * 0.5 + 3 * 0.5) / 20)


def test_the_failure_schedule_is_seeded_and_spares_the_first_peer():
    a = _schedule(3, peers=4, mean=50.0, horizon=1000.0)
    assert a == _schedule(3, peers=4, mean=50.0, horizon=1000.0) and a != _schedule(
        4, peers=4, mean=50.0, horizon=1000.0
    )
    assert {p for _, p, _ in a} == {1, 2, 3} and {k for _, _, k in a} == {"kill", "stall"}
    assert all(t < 1000.0 for t, _, _ in a) and [t for t, _, _ in a] == sorted(t for t, _, _ in a)
    assert 30 <= len(a) <= 100  # about 3 peers x 1000 s / 50 s

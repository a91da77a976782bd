"""Strikes (transports/hivemind/strikes.py): a peer left out of 3 of its last 10 rounds, or whose
part exchange failed, is benched for a while."""

from __future__ import annotations

import logging

import pytest
import torch
from world import HivemindWorld

from diloco_core import Merge, MergeRule, codec_for
from transports.hivemind.strikes import FailedExchanges, Strikes

pytest.importorskip("hivemind")


def test_three_left_outs_of_the_last_ten_rounds_bench_a_peer_until_its_time_is_up(caplog):
    now = [0.0]
    strikes = Strikes(after=3, window=10, seconds=60.0, clock=lambda: now[0])
    group = ["a", "b", "x"]
    for left_out in (["x"], [], [], [], [], [], [], [], [], [], ["x"], [], ["x"]):
        # the first left-out is 12 rounds back by the third: 2 of the last 10
        strikes.round(group, left_out)
    assert not strikes.benched("x")
    with caplog.at_level(logging.WARNING, logger="transports.hivemind.strikes"):
        strikes.round(group, ["x"])  # 3 of the last 10, not in a row
    assert strikes.benched("x") and not strikes.benched("a")
    said = "peer x was left out by the robust merge in 3 of its last 10 rounds: "
    assert [r.getMessage() for r in caplog.records] == [said + "left out of matchmaking for 60 s"]
    now[0] = 59.0
    assert strikes.benched("x")
    now[0] = 60.0
    assert not strikes.benched("x")  # its time is up: it counts from zero again
    strikes.round(group, ["x"])
    assert not strikes.benched("x")


def test_a_failed_exchange_benches_at_once_and_counts_as_a_strike():
    now = [0.0]
    strikes = Strikes(after=3, window=10, seconds=10.0, clock=lambda: now[0])
    strikes.round(["a", "x"], ["x"])
    strikes.failed(["x"], reason="reducer x failed")
    assert strikes.benched("x") and not strikes.benched("a")
    strikes.failed(["y"], reason="sender y failed")
    strikes.round(["a", "y"], [])
    now[0] = 10.0
    assert not strikes.benched("y")
    with pytest.raises(ValueError, match="after=4, window=3"):
        Strikes(after=4, window=3, seconds=1.0)


def test_failed_exchanges_bench_briefly_first_and_twice_as_long_at_each_failure_after():
    """An honest peer whose matchmaking timed out as its group formed (its groupmates blame it) is back two
    matchmaking windows later; a peer that keeps failing is benched twice as long each time, up to the
    longest bench; a peer without a failure for twice that starts from the first again."""
    now = [0.0]
    failures = FailedExchanges(longest=300.0, clock=lambda: now[0])
    assert [failures.bench_seconds("x") for _ in range(6)] == [30.0, 60.0, 120.0, 240.0, 300.0, 300.0]
    assert failures.bench_seconds("y") == 30.0  # per peer
    now[0] = 599.0
    assert failures.bench_seconds("x") == 300.0
    now[0] = 599.0 + 600.0
    assert failures.bench_seconds("x") == 30.0
    strikes = Strikes(after=3, window=10, seconds=100.0, clock=lambda: now[0])
    start = now[0]
    strikes.failed(["x"], reason="sender x failed")
    now[0] = start + 9.9
    assert strikes.benched("x")
    now[0] = start + 10.0
    assert not strikes.benched("x")
    strikes.failed(["x"], reason="sender x failed")  # the second in a row: twice as long
    now[0] = start + 29.9
    assert strikes.benched("x")
    now[0] = start + 30.0
    assert not strikes.benched("x")


def test_a_peer_absent_from_a_round_keeps_its_count():
    strikes = Strikes(after=2, seconds=10.0, clock=lambda: 0.0)
    strikes.round(["a", "x"], ["x"])
    strikes.round(["a", "b"], [])  # x was not in this group
    strikes.round(["a", "x"], ["x"])
    assert strikes.benched("x")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_insider_left_out_three_rounds_in_a_row_is_turned_away_by_the_honest_leaders():
    """3 peers (int8: every peer merges every part); the third sends 1e4 times the first's values every round.
    It is left out of rounds 1-3 and then benched: in the rounds after, a group that an honest peer leads forms
    without it (2 contributors); one that it leads still leaves it out."""
    world = HivemindWorld(3)
    merge = Merge(rule=MergeRule.ROBUST)

    def one_round(t):
        x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) + 0.1 * torch.randn(4096)
        if t.rank == 2:
            x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e4
        return t.all_reduce([x], codec=codec_for("int8"), merge=merge).wait(60)

    try:
        for _ in range(3):
            results = world.run(one_round, timeout=120)
            assert all(r.num_contributors == 3 and len(r.left_out) == 1 for r in results[:2]), results
        later = [world.run(one_round, timeout=120)[:2] for _ in range(6)]
        assert any(all(r.num_contributors == 2 and not r.left_out for r in honest) for honest in later), later
        assert all(r.num_contributors == 2 or len(r.left_out) == 1 for honest in later for r in honest), later
    finally:
        world.close()

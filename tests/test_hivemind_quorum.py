"""hivemind rounds with a quorum and grace window (``transports/hivemind/grace.py``, issue 28): a round closes
without a stalled peer once its window has passed; the late peer takes the round's result and meets the next
round in phase; the window follows the arrival spread every member computes alike."""

from __future__ import annotations

import pytest
import torch
from hivemind_stalls import stalled_swarm

from transports.hivemind import HivemindConfig
from transports.hivemind.auth import unwrap_gather, wrap_gather
from transports.hivemind.grace import MIN_WINDOW, RoundWindows, Window
from transports.quorum import SLACK_FACTOR, Quorum

N = 40
GRACE = MIN_WINDOW
"""The longest window (and the shortest): the stall below outlasts it and its margin (``attempt``: a window
again, at least ``MIN_WINDOW``) by far."""
STALL = 4 * GRACE
MATCHMAKING = 20.0
"""Without a quorum a round would wait this long for the stalled peer: far longer than the test's rounds."""


def _grad(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(70 + rank)
    return torch.randn(N, generator=g) * 0.01 + 0.02 * (rank + 1)


@pytest.mark.slow  # ~12 s; the same quorum rule in-process: test_elastic.py's stalled worker
@pytest.mark.timeout(240)
def test_a_round_closes_without_a_stalled_peer_which_takes_its_result_and_meets_the_next_in_phase():
    # peer 2 stalls before round 2 and misses it; the others pause before round 3, where it meets them
    stall = {(2, 2): STALL, (0, 3): STALL + 2.0, (1, 3): STALL + 2.0}
    results = stalled_swarm(
        name="quorum", grace=GRACE, matchmaking_time=MATCHMAKING, grad=_grad, stall=stall, rounds=lambda r: 4
    )
    params = [p for p, _ in results]
    assert all(torch.equal(params[0], p) for p in params[1:])  # the late peer took the same rounds
    for rank, (_, out) in enumerate(results):
        assert [o[0] if o else None for o in out] == [3, 2 if rank < 2 else None, 3, 3], out
    for rank in (0, 1):  # round 2 closed within its window, not after matchmaking_time, and names who was absent
        _, absent, took = results[rank][1][1]
        assert len(absent) == 1 and took < MATCHMAKING / 2, results[rank][1]
    # round 2's result is the mean of peers 0 and 1: the stalled peer's pseudo-gradient was dropped
    moves = [sum(_grad(r) for r in range(3)) / 3, (_grad(0) + _grad(1)) / 2]
    want = 1.0 - (3 * moves[0] + moves[1])
    torch.testing.assert_close(params[0].view(-1), want, rtol=1e-5, atol=1e-5)


def test_the_window_follows_the_full_rounds_arrival_spread_within_its_bounds():
    windows = RoundWindows(quorum=Quorum(members=3, grace_seconds=4.0), matchmaking_time=3.0)
    assert windows.window("k", target=4) == Window(seconds=3.0, quorum=4)  # nothing measured: a full group
    windows.committed("k", group=4, target=4, spread=20.0)
    first = windows.window("k", target=4)
    assert first.seconds == 3.0 and first.quorum == 3  # within its bound (matchmaking_time caps it)
    for spread in (0.5, 0.6, 0.7, 0.6):
        windows.committed("k", group=4, target=4, spread=spread)
    windows.committed("k", group=3, target=4, spread=0.0)  # a round without a peer says nothing of the spread
    assert windows.window("k", target=4).seconds == pytest.approx(SLACK_FACTOR * 0.6)
    windows.committed("other", group=2, target=2, spread=0.01)
    assert windows.window("other", target=2).seconds == MIN_WINDOW  # the DHT's floor
    assert windows.window("other", target=2).quorum == 2  # never more than the peers expected


def test_a_groupmates_arrival_is_read_only_as_a_finite_number():
    class Msgpack:  # hivemind's serializer, as the averager has it: data_for_gather wraps the user's gather
        from hivemind.utils.serializer import MSGPackSerializer as s

    ser = Msgpack.s

    def sent(gather: object) -> bytes:
        return ser.dumps([0.0, 0, ser.dumps(gather)])

    got = unwrap_gather(ser, sent(wrap_gather(b"t", [3, b"d"], arrived=12.5)))
    assert got.token == b"t" and got.data == [3, b"d"] and got.arrived == 12.5
    assert unwrap_gather(ser, sent([b"t", None, float("nan")])).arrived is None
    assert unwrap_gather(ser, sent([b"t", None, "12"])).arrived is None
    assert unwrap_gather(ser, sent([b"t", None])).token is None  # an old peer's two values: not of this run


def test_quorum_settings_are_checked_with_their_names():
    with pytest.raises(ValueError, match=r"quorum=-1 is invalid: expected an integer >= 0"):
        HivemindConfig(quorum=-1)
    with pytest.raises(ValueError, match=r"grace_seconds=0 is invalid"):
        HivemindConfig(grace_seconds=0)

"""Rounds never mix: every reduce of an untracked key carries its number (transports/hivemind/reduce_number.py)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from threads import together
from world import FAST

from diloco_core import FP32, TransportError

pytestmark = pytest.mark.timeout(120)


def test_the_group_number_is_the_most_held_then_the_highest():
    from transports.hivemind.reduce_number import StepVerdict, step_verdict

    assert step_verdict([(0, 3), (0, 3)], 0) is None
    assert step_verdict([None, None], 1) is None  # a tracked key: the state tags decide
    # one against one: the peer that moved on holds the group's number; the other is behind
    assert step_verdict([(0, 3), (0, 4)], 0) == StepVerdict(group=(0, 4), own=(0, 3), behind=True, apart=1)
    assert step_verdict([(0, 3), (0, 4)], 1) == StepVerdict(group=(0, 4), own=(0, 4), behind=False, apart=1)
    # two of three still retry call 3: they average it; the third, ahead, retries without them
    two = [(0, 3), (0, 4), (0, 3)]
    assert step_verdict(two, 1) == StepVerdict(group=(0, 3), own=(0, 4), behind=False, apart=1)
    assert step_verdict(two, 0).behind is False
    # a later state's first call is ahead of an earlier state's tenth
    assert step_verdict([(1, 0), (0, 9)], 1).behind
    # one insider claiming a far number among three honest peers moves nobody
    assert step_verdict([(0, 2), (0, 2**61), (0, 2)], 0) == StepVerdict(group=(0, 2), own=(0, 2), behind=False, apart=1)


def test_numbers_count_per_key_per_state_and_catch_up_with_the_group():
    from transports.hivemind.reduce_number import ReduceNumbers

    numbers = ReduceNumbers()
    assert [numbers.take("a", rounds=0) for _ in range(3)] == [(0, 0), (0, 1), (0, 2)]
    assert numbers.take("b", rounds=0) == (0, 0)  # per key
    assert numbers.take("a", rounds=2) == (2, 0)  # a new state: counted from it
    numbers.catch_up("a", (2, 7))  # behind its group, still waiting at call 7: the next call is 7
    assert numbers.take("a", rounds=2) == (2, 7)
    numbers.catch_up("a", (2, 1))  # never back
    assert numbers.take("a", rounds=2) == (2, 8)


def test_a_malformed_number_is_none_and_the_verdict_pickles_as_itself():
    from hivemind.utils.serializer import MSGPackSerializer as ser

    from transports.hivemind.auth import unwrap_gather, wrap_gather
    from transports.hivemind.reduce_number import OutOfStepError, StepVerdict

    def sent(number: object) -> bytes:
        return ser.dumps([0.0, 0, ser.dumps(wrap_gather(b"t", None, arrived=1.0, number=number))])

    assert unwrap_gather(ser, sent((3, 4))).number == (3, 4)
    for bad in [None, 3, (1,), (1, -1), (True, 0), (0, 2**62), ("1", 2), (1.0, 2)]:
        assert unwrap_gather(ser, sent(bad)).number is None, bad
    error = OutOfStepError(StepVerdict(group=(0, 4), own=(0, 3), behind=True, apart=1))
    back = pickle.loads(pickle.dumps(error))  # it reaches the transport through hivemind's pipe, pickled
    assert type(back) is OutOfStepError and back.verdict == error.verdict
    assert str(back) == "this peer's call (0, 3) of this key differs from its group's (0, 4)"


def test_a_peer_a_call_behind_never_averages_with_the_next_call():
    """The CI failure: one peer's retry of call n met another's call n + 1 and the two were averaged (15.5 where
    10.5 was due). Here peer 1 has made one call of the key alone that peer 0 never made (as after a call that
    failed on one side): peer 0's call 1 and peer 1's call 2 must not mix."""
    from transports.hivemind import HivemindConfig, HivemindTransport

    cfg = {"run_id": f"numbers-{os.getpid()}", "secret": "n", **FAST, "target_group_size": 2}
    peers = [HivemindTransport(HivemindConfig(**cfg))]
    try:
        peers.append(HivemindTransport(HivemindConfig(**cfg, initial_peers=peers[0].join_addresses)))

        def reduce(peer: HivemindTransport, value: float) -> object:
            x = torch.full((4,), value)
            result = peer.all_reduce([x], codec=FP32, key="k").wait(60)
            return result.num_contributors, float(x[0])

        # call 0 together (both averagers up), then peer 1's call 1 alone: peer 0 never came to it
        assert together([lambda: reduce(peers[0], 1.0), lambda: reduce(peers[1], 3.0)]) == [(2, 2.0), (2, 2.0)]
        assert reduce(peers[1], 5.0) == (1, 5.0)

        def behind_then_next() -> object:  # peer 0's caller goes on at once, as after any failed call
            try:
                return reduce(peers[0], 10.0)
            except TransportError as e:
                assert "moved on" in str(e), e
                return reduce(peers[0], 12.0)

        results = together([behind_then_next, lambda: reduce(peers[1], 21.0)])
        assert not any(r == (2, 15.5) for r in results), results  # today's code: both (2, 15.5)
        # peer 0's call 10 could not meet: its next (its third call, as 21 is peer 1's third) meets peer 1's
        assert results == [(2, 16.5), (2, 16.5)], results
        again = together([lambda: reduce(peers[0], 1.0), lambda: reduce(peers[1], 3.0)])
        assert again == [(2, 2.0), (2, 2.0)], again  # in step
    finally:
        for p in peers:
            p.close()

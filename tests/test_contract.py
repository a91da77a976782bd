"""The Transport contract, run on every transport at world sizes 2 and 3 (see conftest.world)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from faults import Action, Fault, FaultyTransport, Phase
from world import RankError

from diloco_core import Membership, Merge, MergeRule, TransportError, codec_for, reference_mean
from transports import ForwardingTransport, InProcessGroup, InProcessTransport
from transports.simulated_link import SimulatedLink

pytestmark = pytest.mark.timeout(180)

SHAPES = [(7, 3), (5,), (2, 2, 3)]  # odd sizes: shards and buckets never divide evenly


def _contribution(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(s, generator=g) * (rank + 1) for s in SHAPES]


def _reduce(transport, wire_dtype: str, block: int = 256):
    tensors = _contribution(transport.rank)
    result = transport.all_reduce(tensors, codec=codec_for(wire_dtype, block=block)).wait(30)
    return tensors, result


def _ok(results: list) -> list:
    errors = [r for r in results if isinstance(r, RankError)]
    assert not errors, errors
    return results


def _reference(n: int, codec) -> list[torch.Tensor]:
    """The reference mean of every rank's contribution: its tensors travel as one payload, concatenated."""
    flat = [torch.cat([t.reshape(-1) for t in _contribution(r)]) for r in range(n)]
    return [m.view(s) for m, s in zip(reference_mean(flat, codec).split([math.prod(s) for s in SHAPES]), SHAPES)]


@pytest.mark.parametrize(
    "wire_dtype", ["fp32", "fp16", "bf16", "int8", "int4", "int8/16", "int4/16", "int2/16", "sign/32", "topk/32"]
)
def test_mean_over_contributors_in_every_wire_dtype(world, wire_dtype):
    # block 16: several blocks, a partial one, torch's shards (topk at 32: one value of each block)
    name, _, block = wire_dtype.partition("/")
    codec = codec_for(name, block=int(block or 256))
    results = _ok(world.run(_reduce, name, codec.block))
    n = world.world_size
    expected = _reference(n, codec)
    if not world.capabilities.exact_mean and codec.elementwise_dtype is not None:
        # a cast's mean comes back rounded to the wire once more; a block codec's never is (re-quantized)
        expected = [want.to(codec.elementwise_dtype).float() for want in expected]
    for tensors, result in results:
        assert result.num_contributors == n
        assert result.bytes_sent > 0 and result.seconds >= 0
        for got, want in zip(tensors, expected):
            if wire_dtype == "fp32" and n > 2:  # a ring sums in its own order: equal up to fp32 rounding
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            else:  # other wires sum decoded payloads in rank order in fp32; two fp32 addends commute exactly
                assert torch.equal(got, want)
    first = results[0][0]
    for tensors, _ in results[1:]:  # every rank holds the very same bits
        assert all(torch.equal(a, b) for a, b in zip(first, tensors))


def _bytes(transport, wires: list[str]):
    x = [torch.ones(10_000)]
    return {w: transport.all_reduce(x, codec=codec_for(w)).wait(30).bytes_sent for w in wires}


def test_narrower_wires_send_fewer_bytes(world):
    wires = ["fp32", "fp16", "int8", "int4"]
    for sent in _ok(world.run(_bytes, wires)):
        assert [sent[w] for w in wires] == sorted(sent.values(), reverse=True) and len(set(sent.values())) == len(wires)


def _attacked(transport, codec: str, scale: float):
    """Every rank sends an honest contribution but the last, which sends rank 0's scaled by ``scale``."""
    tensors = _contribution(transport.rank)
    if transport.rank == 2:
        tensors = [t * scale for t in _contribution(0)]
    merge = Merge(rule=MergeRule.ROBUST)
    return tensors, transport.all_reduce(tensors, codec=codec_for(codec, block=16), merge=merge).wait(30)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_the_robust_merge_leaves_an_outlier_out_on_every_transport(world, codec):
    """With 3 members, the third's contribution 1e4 times another's is left out: the result is the mean of the
    other two on every member, and the members that merged it name it; with 2 there is no majority: the mean."""
    results = _ok(world.run(_attacked, codec, 1e4))
    n = world.world_size
    c = codec_for(codec, block=16)
    honest = [torch.cat([t.reshape(-1) for t in _contribution(r)]) for r in range(2)]
    want = reference_mean(honest, c)
    if not world.capabilities.exact_mean and c.elementwise_dtype is not None:
        want = want.to(c.elementwise_dtype).float()  # hivemind rounds a cast's mean to the wire once more
    for tensors, result in results:
        got = torch.cat([t.reshape(-1) for t in tensors])
        assert result.num_contributors == n
        if n == 2:
            assert result.left_out == ()
            continue
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert all(o.ratio > 100 for o in result.left_out)
        if world.capabilities.fixed_ranks:
            assert [o.who for o in result.left_out] == ["rank 2"]
    if n > 2:  # hivemind: the part's reducer saw it (38 values: one part)
        assert any(result.left_out for _, result in results)


def _broadcast(transport, src: int):
    values = [torch.arange(6).view(2, 3) * (transport.rank + 1), torch.randn(4, dtype=torch.float64)]
    if transport.rank == src:
        values[1] = torch.tensor([1.5, -2.25, 1e-30, 3.0], dtype=torch.float64)
    transport.broadcast(values, src=src, timeout=30)
    return values


@pytest.mark.parametrize("src", ["first", "last"])
def test_broadcast_is_exact_for_any_dtype(world, src):
    src_rank = 0 if src == "first" else world.world_size - 1
    if src_rank and not world.capabilities.broadcast_from_any_rank:  # src=0 only: whoever holds the state
        for r in world.run(_broadcast, src_rank):
            assert isinstance(r, RankError) and r.type == "ValueError" and f"src={src_rank}" in r.message, r
        return
    for ints, floats in _ok(world.run(_broadcast, src_rank)):
        assert torch.equal(ints, torch.arange(6).view(2, 3) * (src_rank + 1))
        assert torch.equal(floats, torch.tensor([1.5, -2.25, 1e-30, 3.0], dtype=torch.float64))


def _bad_input(transport):
    errors = {}
    for name, call in {
        "fp64": lambda: transport.all_reduce([torch.ones(3, dtype=torch.float64)]),
        "empty": lambda: transport.all_reduce([]),
        "wire": lambda: transport.all_reduce([torch.ones(3)], codec="int8"),
        "src": lambda: transport.broadcast([torch.ones(3)], src=transport.world_size, timeout=5),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    # the group still works after refusing bad input
    x = [torch.full((3,), float(transport.rank))]
    transport.all_reduce(x).wait(30)
    return errors, x[0]


def test_bad_input_is_a_clear_value_error(world):
    for errors, x in _ok(world.run(_bad_input)):
        assert "float64" in errors["fp64"]
        assert "at least one tensor" in errors["empty"]
        assert "codec='int8'" in errors["wire"] and "fp16" in errors["wire"]
        assert "src=" in errors["src"]
        assert torch.equal(x, torch.full((3,), (world.world_size - 1) / 2))


def _one_rank_absent(transport, n: int, timeout: float, absent_for: float, done: str):
    """The last of the ``n`` ranks stays absent (alive, never joining the reduce) until every other rank has
    written its file under ``done`` (nothing is left for it to miss then), or for ``absent_for`` seconds at most;
    it returns when it stopped being absent. ``n``, not ``transport.world_size``: in-process, that counts only
    the ranks that have not left yet, and a rank that started after another had finished took itself for the
    absent one."""
    if transport.rank == n - 1:
        until = time.monotonic() + absent_for
        while time.monotonic() < until and len(list(Path(done).iterdir())) < n - 1:
            time.sleep(0.05)
        return time.monotonic()
    start = time.monotonic()  # the machine's monotonic clock: comparable across the processes of a gloo world
    x = [torch.full((4,), float(transport.rank))]
    try:
        result = transport.all_reduce(x).wait(timeout)
    except TransportError as e:
        outcome = "error", (start, time.monotonic()), str(e)
    else:
        outcome = "done", result.num_contributors, x[0][0].item()
    (Path(done) / str(transport.rank)).touch()
    return outcome


def test_an_absent_rank_fails_the_others_within_the_timeout_or_is_left_out_as_declared(world, tmp_path):
    n, caps = world.world_size, world.capabilities
    # Fixed ranks: the reduce waits for every rank, so it fails within its timeout. Peers that come and go:
    # the round's group is whoever shows up (hivemind: after its matchmaking time).
    timeout = 2.0 if caps.fixed_ranks else 20.0
    # Fixed ranks: the absent rank stays away until the others are done, however long a loaded machine makes
    # that (it used to leave after 3 x the timeout, and a slow enough machine saw its leaving end the reduce);
    # only a wait that ignored its timeout keeps it away this long, and then the reduce must not end before it.
    absent_for = 10 * timeout if caps.fixed_ranks else timeout + 1.5
    done = str(tmp_path)
    fresh = {"fresh": True} if hasattr(world, "_procs") else {}
    runs = world.run(_one_rank_absent, n, timeout, absent_for, done, **fresh)
    *others, left = runs  # when the absent rank stopped being absent (the machine's monotonic clock)
    errors = [o for o in others if isinstance(o, tuple) and o[0] == "error"]
    first = min((start for _, (start, _), _ in errors), default=0.0)  # the first call's start
    for outcome in others:
        assert isinstance(outcome, tuple), outcome
        if caps.fixed_ranks:
            assert outcome[0] == "error", outcome  # not completed once the absent rank left (in-process)
            _, (_, end), message = outcome
            # within its timeout: while the absent rank was still absent, not by its leaving; not before the first
            # caller's timeout (in-process, the first to time out fails it for every rank)
            assert first + timeout <= end < left and "within" in message, (outcome, left)
        else:
            assert outcome == ("done", n - 1, (n - 2) / 2)


def _two_keys_in_flight(transport):
    a = [torch.full((5,), float(transport.rank))]
    b = [torch.arange(7, dtype=torch.float32) * (transport.rank + 1)]
    handle_a = transport.all_reduce(a, key="fragment/0")
    handle_b = transport.all_reduce(b, codec=codec_for("fp16"), key="fragment/1")
    n_b = handle_b.wait(30).num_contributors
    n_a = handle_a.wait(30).num_contributors
    return a[0], b[0], n_a, n_b


def test_reduces_with_different_keys_are_in_flight_at_once(world):
    n = world.world_size
    for a, b, n_a, n_b in _ok(world.run(_two_keys_in_flight)):
        assert n_a == n_b == n
        assert torch.equal(a, torch.full((5,), (n - 1) / 2))
        want = reference_mean([torch.arange(7, dtype=torch.float32) * (r + 1) for r in range(n)], "fp16")
        assert torch.equal(b, want)


def _keys_in_either_order(transport, any_order: bool):
    a, b = [torch.full((4,), float(transport.rank))], [torch.full((2,), 100.0 + transport.rank)]
    order = [("a", a), ("b", b)] if any_order and transport.rank % 2 == 0 else [("b", b), ("a", a)]
    handles = [transport.all_reduce(x, key=key) for key, x in order]
    for h in handles:
        h.wait(30)
    return a[0], b[0]


def test_reduces_meet_by_key_in_any_order_where_declared_else_in_the_same_order(world):
    # torch.distributed matches collectives by order: every rank starts the keys in the same order there.
    n, any_order = world.world_size, world.capabilities.keys_in_any_order
    for a, b in _ok(world.run(_keys_in_either_order, any_order)):
        assert torch.equal(a, torch.full((4,), (n - 1) / 2)) and torch.equal(b, torch.full((2,), 100.0 + (n - 1) / 2))


# -- faults, injected through FaultyTransport; what survivors see depends on declared capabilities ----------


def _rounds_with(transport, faults: list, rounds: int, timeout: float):
    t = FaultyTransport(transport, faults)
    out = []
    for r in range(rounds):
        x = [torch.full((6,), float(transport.rank + 10 * r))]
        try:
            res = t.all_reduce(x).wait(timeout)
            out.append((res.num_contributors, x[0][0].item()))
        except TransportError as e:
            out.append(("error", str(e)))
    return out, t.capabilities


def test_a_straggler_within_the_timeout_is_waited_for(world):
    n = world.world_size
    fault = Fault(rank=n - 1, round=2, phase=Phase.START, action=Action.DELAY, seconds=1.5)
    # Hivemind waits for a late peer only as long as its matchmaking window, 2 x matchmaking_time from the first
    # peer's start: FAST's 4 s left the straggler's matchmaking (and a first round's averager start-up) 2.5 s, which
    # a loaded machine can use up. 20 s leaves it 18.5; the full group still starts once every peer is in.
    patient = {} if world.capabilities.fixed_ranks else {"settings": {"matchmaking_time": 10.0}}
    for out, _ in _ok(world.run(_rounds_with, [fault], 3, 30.0, **patient)):
        assert out == [(n, (n - 1) / 2 + 10 * r) for r in range(3)]


def test_a_crashed_member_is_left_out_or_fails_the_others_within_their_timeout(world):
    n = world.world_size
    fault = Fault(rank=n - 1, round=2, phase=Phase.START, action=Action.CRASH)
    wait = 3.0 if world.capabilities.fixed_ranks else 20.0  # hivemind: a matchmaking without the crashed peer
    results = world.run(_rounds_with, [fault], 2, wait, timeout=60)
    # bounded: every member ended within the run's 60 s (one still running then is a RankError), never a hang
    assert not any(isinstance(r, RankError) for r in results), results
    *survivors, (crashed, _) = results
    assert crashed[1][0] == "error" and "injected crash" in crashed[1][1]
    for out, caps in survivors:
        assert out[0] == (n, (n - 1) / 2)
        if caps.survives_leavers:  # the round completes among the members that remain
            assert out[1] == (n - 1, (n - 2) / 2 + 10)
        else:
            assert out[1][0] == "error"


# -- membership: the second interface, for transports whose peers come and go ------------------------------


def _is_membership(transport):
    return isinstance(transport, Membership), transport.capabilities.fixed_ranks


def test_transports_whose_peers_come_and_go_and_only_those_serve_membership(world):
    for is_membership, fixed_ranks in _ok(world.run(_is_membership)):  # hivemind's is seen through a wrapper
        assert is_membership == (not fixed_ranks)


class _Joinable(InProcessTransport, Membership):
    """An in-process member that records what the Membership calls did to it."""

    join_addresses = ("/ip4/10.0.0.1/tcp/1",)

    def __init__(self) -> None:
        super().__init__(InProcessGroup(1), 0)
        self.calls: list = []

    def attach(self, state, timeout):
        self.calls.append(("attach", state, timeout))
        return True

    def state_dict(self):
        return {"tag": 7}

    def load_state_dict(self, state):
        self.calls.append(("load", state))


def test_a_wrapper_is_a_membership_exactly_when_what_it_wraps_is_one():
    fixed = InProcessGroup(1).transport(0)
    assert not isinstance(ForwardingTransport(fixed), Membership)
    assert not isinstance(SimulatedLink(fixed, bandwidth=1e9), Membership)
    inner = _Joinable()
    for wrapper in [ForwardingTransport(inner), SimulatedLink(inner, bandwidth=1e9)]:
        assert isinstance(wrapper, Membership) and isinstance(wrapper, ForwardingTransport)
        assert type(wrapper).__name__ in ("ForwardingTransport", "SimulatedLink")
        assert list(wrapper.join_addresses) == ["/ip4/10.0.0.1/tcp/1"]
        assert wrapper.attach("state", 5.0) is True and wrapper.state_dict() == {"tag": 7}
        wrapper.load_state_dict({"tag": 8})
        x = [torch.ones(3)]
        assert wrapper.all_reduce(x).wait(5).num_contributors == 1
    assert inner.calls == [("attach", "state", 5.0), ("load", {"tag": 8})] * 2
    assert isinstance(SimulatedLink(SimulatedLink(inner, bandwidth=1e9), bandwidth=1e9), Membership)

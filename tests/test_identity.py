"""Collective identity on the torch transport (issue 13, case 2): no reduce is ever paired with a different
one, and a reduce that failed leaves the group unusable instead of shifting every later pairing."""

from __future__ import annotations

import time

import pytest
import torch
from faults import Action, Fault, FaultyTransport, Phase
from world import GROUP_TIMEOUT_S, RankError, ThreadWorld

from diloco_core import BlockCodec, DiLoCo, DiLoCoConfig, TransportError, codec_for

pytestmark = pytest.mark.timeout(120)
WAIT_S = 30.0


def _codec(name: str):
    if "/" in name:  # name/block
        codec, block = name.split("/")
        return codec_for(codec, block=int(block))
    if name == "int4v1":  # int4 before its nibbles became two's complement: the same name and block
        old = BlockCodec("int4", bits=4)
        old.layout = 1
        return old
    return codec_for(name)


def _reduce(transport, keys: list[str], wires: list[str]):
    key, wire = keys[transport.rank], _codec(wires[transport.rank])
    start = time.monotonic()
    try:
        transport.all_reduce([torch.ones(1000)], codec=wire, key=key).wait(WAIT_S)
    except TransportError as e:
        first = str(e)
    else:
        return "reduced", time.monotonic() - start
    try:  # the group is unusable now: any later call fails at once
        transport.all_reduce([torch.ones(3)]).wait(WAIT_S)
    except TransportError as e:
        return first, str(e), time.monotonic() - start
    return first, "a later reduce ran", time.monotonic() - start


@pytest.mark.parametrize(
    ("keys", "wires", "shown"),
    [
        # each wire with the path it takes (wire_bytes.path_of): fp32's ring, the others' gather at 2 ranks
        (["a", "a"], ["fp32", "fp16"], ["'a' #1 (1000 values, fp32 by ring)", "'a' #1 (1000 values, fp16 by gather)"]),
        # codecs that differ only in their payload's layout never average together
        (
            ["a", "a"],
            ["int4", "int4v1"],
            ["'a' #1 (1000 values, int4b256v2 by gather)", "'a' #1 (1000 values, int4b256 by gather)"],
        ),
        # a key this rank never used is shown by its hash
        (["a", "b"], ["fp32", "fp32"], ["'a' #1 (1000 values, fp32 by ring)", "'b' #1 (1000 values, fp32 by ring)"]),
    ],
)
def test_reduces_that_differ_are_never_paired_and_fail_fast_on_both_ranks(gloo, keys, wires, shown):
    results = gloo.run(_reduce, keys, wires, timeout=60, fresh=True)
    assert not any(isinstance(r, RankError) for r in results), results
    for rank, (first, later, took) in enumerate(results):
        other = shown[1 - rank] if keys[0] == keys[1] else shown[1 - rank].split(" ", 1)[1]  # "#1 (1000 ..."
        assert first.startswith(f"collective mismatch: rank {1 - rank} is at reduce") and shown[rank] in first
        assert other in first, first
        assert "unusable since a reduce met a different one" in later and "--max-restarts" in later
        assert took < WAIT_S / 2, took  # the header's exchange: well under the 30 s timeout it would wait out


def _digests_with_a_straggler(transport, rounds: int, stall: float, timeout: float, phase: Phase = Phase.WAIT):
    """Rank 1 stalls past the timeout in round 2's reduce, then goes on (SIGSTOP/SIGCONT, a long GC pause).
    Returns [(round, contributors, global params)] and how it ended."""
    fault = Fault(rank=1, round=2, phase=phase, action=Action.DELAY, seconds=stall, key="diloco/round")
    t = FaultyTransport(transport, [fault])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, reduce_timeout=timeout, round_retries=2))
    data, out = torch.Generator().manual_seed(transport.rank), []
    for _ in range(rounds):
        model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
        try:
            report = diloco.step()
        except TransportError as e:
            return out, str(e)
        opt.zero_grad()
        out.append((report.round, report.num_contributors, torch.cat([p.reshape(-1) for p in diloco.global_params])))
    return out, "finished"


def test_a_straggler_past_the_timeout_ends_in_a_clear_error_on_every_rank_never_a_silent_pairing(gloo):
    """Before: the timed-out reduce was abandoned, the retry started a new one, the straggler's late call
    paired with it, and every later round reported 2 contributors while the replicas differed. The stall is
    at the start of round 2's reduce: a stopped process stops its communication thread too, so nothing of
    its reduce is posted (a stall at the wait alone no longer delays the reduce: it runs in the background)."""
    start = time.monotonic()
    results = gloo.run(_digests_with_a_straggler, 6, 6.0, 3.0, Phase.START, timeout=90, fresh=True)
    assert time.monotonic() - start < GROUP_TIMEOUT_S  # a rank that waited out gloo's own timeout takes longer
    assert not any(isinstance(r, RankError) for r in results), results
    for rank, (rounds, error) in enumerate(results):
        assert error != "finished" and len(rounds) < 6, (rank, rounds, error)  # nobody trains on past the fault
        assert "torch.distributed" in error, error  # a clear TransportError: timed out, or the group unusable
    (done0, error0), (done1, _) = [([r[0] for r in rounds], error) for rounds, error in results]
    assert done0 == [1] and "unusable" in error0  # rank 0 timed out in round 2; its retries failed at once
    assert done1 == [1]  # its late header met rank 0's posted one; rank 0's given-up reduce posted no payload


def test_in_process_a_straggler_past_the_timeout_meets_the_others_retry_never_their_next_round():
    """Before: rank 1, stalled past rank 0's timeout in round 2, joined rank 0's abandoned round-3 reduce with
    its own round 3, and from then on every round reported 2 contributors while the replicas differed. Now an
    abandoned reduce fails for every rank, and the straggler's retry meets rank 0's retry."""
    results = ThreadWorld(2).run(_digests_with_a_straggler, 6, 4.0, 2.0, timeout=120)
    assert not any(isinstance(r, RankError) for r in results), results
    (rounds0, end0), (rounds1, end1) = results
    assert end0 == end1 == "finished", (end0, end1)
    assert [r[:2] for r in rounds0] == [r[:2] for r in rounds1] == [(i, 2) for i in range(1, 7)]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(rounds0, rounds1))  # identical after every round


def _reduce_in_process(transport, wires: list[str]):
    start = time.monotonic()
    try:
        transport.all_reduce([torch.ones(1000)], codec=_codec(wires[transport.rank])).wait(WAIT_S)
    except TransportError as e:
        return str(e), time.monotonic() - start
    return "reduced", time.monotonic() - start


@pytest.mark.parametrize("wires", [["int8", "int8/128"], ["int4", "int4v1"]])
def test_in_process_codecs_that_differ_in_block_or_layout_are_never_paired(wires):
    """The in-process group matches a collective's codec by its whole identity (name, block, layout): before, it
    compared names alone, so int8 with 128-value blocks met int8 with 256 and the ranks waited out their timeout."""
    results = ThreadWorld(2).run(_reduce_in_process, wires, timeout=60)
    assert not any(isinstance(r, RankError) for r in results), results
    for message, took in results:
        assert "mismatched" in message, message
        assert took < WAIT_S / 2, took  # refused as the second rank joins, well before the 30 s wait

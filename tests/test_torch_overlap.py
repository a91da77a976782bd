"""The torch transport runs a reduce in the background: it completes while its caller trains on, without a
``wait`` (what overlap modes need), several may be in flight, and a given-up one leaves nothing running."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch
from world import GlooWorld, RankError

from diloco_core import TransportError, codec_for, reference_mean
from transports import TorchDistTransport

pytestmark = pytest.mark.timeout(120)


def _comm_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("diloco-torch-comm")}


def _left(before: set[threading.Thread]) -> list[str]:
    """Communication threads alive now that were not before (their names: threads do not pickle)."""
    return sorted(t.name for t in _comm_threads() - before)


def _contribution(rank: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * seed + rank)
    return [torch.randn(1001, generator=g), torch.randn(3, 5, generator=g)]


def _reference(world_size: int, codec, seed: int = 0) -> torch.Tensor:
    flat = [torch.cat([t.reshape(-1) for t in _contribution(r, seed)]) for r in range(world_size)]
    return reference_mean(flat, codec)


def _busy_caller(transport, wire: str, marker: str):
    """Rank 1 waits and leaves a marker; rank 0 computes meanwhile and only waits once the marker is there."""
    before = _comm_threads()
    t = TorchDistTransport(bucket_mb=0.001)  # 250-value buckets: several collectives and fp32 steps between
    x = _contribution(t.rank)
    handle = t.all_reduce(x, codec=codec_for(wire, 256), key=f"busy/{wire}")
    seen, wait = None, 30.0
    if t.rank == 1:
        result = handle.wait(wait)
        open(marker, "w").close()
    else:
        # as long as rank 1 may wait: a reduce that needed rank 0's wait to progress never leaves the marker
        deadline, a = time.monotonic() + wait, torch.randn(64, 64)
        while not os.path.exists(marker) and time.monotonic() < deadline:
            a = (a @ a).tanh_()  # the caller trains on, never waiting
        seen = os.path.exists(marker)
        result = handle.wait(wait)
    t.close()
    return seen, result.num_contributors, torch.cat([v.reshape(-1) for v in x]), _left(before)


@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_a_reduce_completes_while_its_caller_is_busy_and_never_waits(gloo, wire, tmp_path):
    marker = str(tmp_path / f"{wire}.waited")
    results = gloo.run(_busy_caller, wire, marker)
    assert not any(isinstance(r, RankError) for r in results), results
    (seen, n0, mean0, left0), (_, n1, mean1, left1) = results
    assert seen is True  # rank 1's wait returned, so rank 0's side had run without its wait
    assert n0 == n1 == 2 and left0 == left1 == []  # close() stopped the communication thread
    assert torch.equal(mean0, mean1)
    want = _reference(2, codec_for(wire, 256))
    if wire == "fp32":
        torch.testing.assert_close(mean0, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(mean0, want)


def _keys_and_a_broadcast_in_flight(transport):
    before = _comm_threads()
    t = TorchDistTransport(bucket_mb=0.001)
    a, b = _contribution(t.rank, seed=1), _contribution(t.rank, seed=2)
    handle_a = t.all_reduce(a, codec=codec_for("int8", 256), key="fragment/0")
    handle_b = t.all_reduce(b, key="fragment/1")
    state = [torch.full((4,), float(t.rank)), torch.arange(3) * (t.rank + 1)]
    t.broadcast(state, src=1, timeout=30)  # queued behind both reduces: never between their collectives
    results = [handle_a.wait(30), handle_b.wait(30)]
    del t, handle_a, handle_b  # dropped without close(): its thread stops all the same
    gc.collect()
    flat = [torch.cat([v.reshape(-1) for v in x]) for x in (a, b)]
    return flat, state, [r.num_contributors for r in results], _left(before)


def test_two_keys_and_a_broadcast_in_flight_keep_their_order(gloo):
    results = gloo.run(_keys_and_a_broadcast_in_flight)
    assert not any(isinstance(r, RankError) for r in results), results
    for (a, b), state, contributors, left in results:
        assert contributors == [2, 2] and left == []
        assert torch.equal(a, _reference(2, codec_for("int8", 256), seed=1))
        torch.testing.assert_close(b, _reference(2, codec_for("fp32"), seed=2), rtol=1e-6, atol=1e-6)
        assert torch.equal(state[0], torch.full((4,), 1.0)) and torch.equal(state[1], torch.arange(3) * 2)


ABSENT_S = 5.0
"""How long rank 1 stays away from rank 0's reduce: what rank 0 would wait for if it ignored its 1 s timeout."""
CLOSE_JOIN_S = 5.0
"""How long ``TorchDistTransport.close`` waits for its communication thread to end."""


def _given_up(transport):
    before = _comm_threads()
    t = TorchDistTransport()
    if t.rank == 1:  # never joins: rank 0's header finds no peer's
        time.sleep(ABSENT_S)
        t.close()
        return None
    start = time.monotonic()
    try:
        t.all_reduce([torch.ones(10)]).wait(1.0)
        first = "no error"
    except TransportError as e:
        first = str(e)
    waited = time.monotonic() - start
    start = time.monotonic()
    try:
        t.all_reduce([torch.ones(10)])
        later = "started"
    except TransportError as e:
        later = str(e)
    refused_in = time.monotonic() - start
    start = time.monotonic()
    t.close()
    return first, waited, later, refused_in, time.monotonic() - start, _left(before)


def test_a_reduce_given_up_leaves_the_group_unusable_and_close_stops_its_thread(tmp_path):
    world = GlooWorld(2, str(tmp_path))
    try:
        results = world.run(_given_up, timeout=60, fresh=True)
    finally:
        world.close()
    assert not isinstance(results[0], RankError), results
    first, waited, later, refused_in, closed_in, left = results[0]
    # Bounds a loaded machine cannot cross by seconds: the timeout fired, and the refusal came, while rank 1
    # was still away (a wait for it would have ended only then); close did not wait out its thread's join.
    assert "did not start within 1s" in first and 1.0 <= waited < ABSENT_S, (first, waited)
    assert "unusable since a reduce failed" in later and waited + refused_in < ABSENT_S, (later, refused_in)
    assert left == [] and closed_in < CLOSE_JOIN_S / 2, (left, closed_in)  # the cancelled job ended at once

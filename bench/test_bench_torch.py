"""The gloo transport against raw ``dist.all_reduce``, and its 16-bit, int8/int4/int2, sign and topk wires against its
fp32 one: 2 processes on 127.0.0.1, 25M fp32 values, side by side in one session (each call encodes,
exchanges and decodes: the whole reduce of a round, error feedback aside; ``-eager``: the codec without its
fused CPU kernels); with 3 processes, the robust merge (``diloco_core.merge``) beside the plain mean; with 4,
each wire's path against the fp32 ring.

    python -m pytest bench/test_bench_torch.py --benchmark-only
    python -m pytest bench/test_bench_torch.py --benchmark-only -k robust  # the robust merge's cost
    bench/shaped_link.sh 1gbit python -m pytest bench/test_bench_torch.py --benchmark-only -k 4_ranks
    python -m pytest bench/test_bench_torch.py --benchmark-only -k interleaved  # the LAN target alone
    bench/shaped_link.sh 1gbit python -m pytest bench/test_bench_torch.py --benchmark-only  # a 1 Gbit/s link

This process is rank 0 and times each call; rank 1 is a spawned process that runs the same call on
command, so both ranks enter every collective together. The LAN target (the fp32 mean within 1.05x of a
raw ``dist.all_reduce`` + divide on the same tensor) is ``test_gloo_fp32_against_raw_interleaved``: the two
alternate rep by rep, so both see the same load on a shared machine, and it reports their median ratio.
"""

from __future__ import annotations

import copy
import datetime
import functools
import multiprocessing as mp
import os
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from diloco_core import MEAN, Codec, Merge, MergeRule, codec_for
from transports import TorchDistTransport

N = 25_000_000
GROUP = "2 gloo processes, 25M fp32 values"


@functools.cache  # one codec per name: a block codec keeps its chunk buffers from call to call
def _codec(name: str) -> Codec:
    """``int8-eager``: int8 without its fused CPU kernels (``diloco_core.codecs.kernels``), for comparison."""
    if name.endswith("-eager"):
        codec = copy.copy(codec_for(name.removesuffix("-eager")))
        codec.fused = False
        return codec
    codec = codec_for(name)
    codec.prepare(torch.empty(()).expand(N))  # its kernels compiled before any timed round (a view: no 100 MB)
    return codec


def _op(name: str, transport: TorchDistTransport, x: torch.Tensor) -> None:
    """``raw``, a codec's name, or ``<codec>-robust`` (the robust merge; every other: the plain mean)."""
    if name == "raw":  # the mean, as the transport returns: all_reduce + divide (a bare sum would overflow x)
        dist.all_reduce(x)
        x.div_(dist.get_world_size())
    elif name.endswith("-robust"):
        merge = Merge(rule=MergeRule.ROBUST)
        transport.all_reduce([x], codec=_codec(name.removesuffix("-robust")), merge=merge).wait(120)
    else:
        transport.all_reduce([x], codec=_codec(name), merge=MEAN).wait(120)


def _peer(store: str, rank: int, world: int, commands: mp.Queue, done: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    transport = TorchDistTransport()
    torch.manual_seed(rank)
    x = torch.randn(N)
    while (name := commands.get()) is not None:
        _op(name, transport, x)
        done.put(name)
    dist.destroy_process_group()


def _world(tmp_path_factory, world: int):
    """This process as rank 0 of ``world`` gloo processes: ``run(name)`` has every rank run ``_op(name)``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the peers: one core each
    store = str(tmp_path_factory.mktemp("gloo") / "store")
    ctx = mp.get_context("spawn")
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(world - 1)]
    peers = [ctx.Process(target=_peer, args=(store, r + 1, world, *q), daemon=True) for r, q in enumerate(queues)]
    for peer in peers:
        peer.start()
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=world, timeout=timeout)
    transport = TorchDistTransport()
    x = torch.randn(N)

    def run(name: str) -> None:
        for commands, _ in queues:
            commands.put(name)
        _op(name, transport, x)
        for _, done in queues:
            done.get(timeout=120)

    yield run
    for (commands, _), peer in zip(queues, peers):
        commands.put(None)
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from _world(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    yield from _world(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def quad(tmp_path_factory):
    yield from _world(tmp_path_factory, 4)


@pytest.mark.parametrize(
    "name", ["raw_baseline", "fp32", "fp16", "bf16", "int8", "int8-eager", "int4", "int4-eager", "int2", "sign", "topk"]
)
def test_gloo_all_reduce_25m(benchmark, pair, name):
    benchmark.group = GROUP
    op = "raw" if name == "raw_baseline" else name
    benchmark.pedantic(pair, args=(op,), rounds=20, warmup_rounds=3)


INTERLEAVED_REPS = 9
"""Reps of the interleaved pair (>= 7, the target's median), after 3 unrecorded ones."""


def test_gloo_fp32_against_raw_interleaved(benchmark, pair):
    """Raw ``dist.all_reduce`` + divide and the transport's fp32 mean on the same tensor, one after the other in
    every rep (the order alternating rep by rep): the ratio of their medians, and the median of the per-rep
    ratios, are in the summary (bench/conftest.py). The benchmark's own time is the pair's."""
    benchmark.group = f"{GROUP}, raw and fp32 interleaved"
    times: dict[str, list[float]] = {"raw": [], "fp32": []}
    calls = [0]

    def rep() -> None:
        order = ["raw", "fp32"] if calls[0] % 2 == 0 else ["fp32", "raw"]
        calls[0] += 1
        for name in order:
            start = time.perf_counter()
            pair(name)
            times[name].append(time.perf_counter() - start)

    benchmark.pedantic(rep, rounds=INTERLEAVED_REPS, warmup_rounds=3)
    raw, fp32 = (times[name][-INTERLEAVED_REPS:] for name in ("raw", "fp32"))
    benchmark.extra_info["ratio"] = (
        f"fp32 {statistics.median(fp32) * 1e3:.1f} ms / raw all_reduce + divide {statistics.median(raw) * 1e3:.1f} ms "
        f"(medians of {INTERLEAVED_REPS} interleaved reps) = {statistics.median(fp32) / statistics.median(raw):.3f}x; "
        f"median per-rep ratio {statistics.median(f / r for f, r in zip(fp32, raw)):.3f}x"
    )


@pytest.mark.parametrize("name", ["fp32-baseline", "fp32-robust", "int4", "int4-robust"])
def test_gloo_3_ranks_robust_merge_25m(benchmark, trio, name):
    """The robust merge's cost on a whole reduce: 3 gloo processes (where it judges: 2 have no majority), each
    codec's plain mean beside its robust merge of honest contributions (nothing left out). fp32's plain mean is
    the backend's ring; its robust merge reduce-scatters the payloads, merges each shard, and all-gathers."""
    benchmark.group = "3 gloo processes, 25M fp32 values, plain and robust merge"
    benchmark.pedantic(trio, args=(name.removesuffix("-baseline"),), rounds=8, warmup_rounds=2)


@pytest.mark.parametrize("name", ["fp32-baseline", "int4", "int2", "sign", "topk"])
def test_gloo_4_ranks_25m(benchmark, quad, name):
    """4 gloo processes (2 per core here): the fp32 ring beside each narrower wire's path (``wire_bytes.path_of``:
    at 4 ranks each of these sends its payload to every peer; before 2026-12-06 they all-gathered fp32 shard
    sums, 3 bytes a value). On a shaped link (bench/shaped_link.sh) the bytes decide."""
    benchmark.group = "4 gloo processes, 25M fp32 values"
    benchmark.pedantic(quad, args=(name.removesuffix("-baseline"),), rounds=5, warmup_rounds=1)

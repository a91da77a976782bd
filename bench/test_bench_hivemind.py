"""One round of averaging 25M fp32 values between 2 peers on 127.0.0.1: our transport vs hivemind's
``DecentralizedAverager`` used directly with the same settings (OpenDiLoCo's path), fp32 and fp16 wire;
and our int8 / int4 / int2 / sign / topk wires against our fp32 one (the block codecs with their fused CPU kernels,
compiled first, as ``DiLoCo`` compiles them when built).

    python -m pytest bench/test_bench_hivemind.py --benchmark-only
    bench/shaped_link.sh 1gbit python -m pytest bench/test_bench_hivemind.py --benchmark-only -k wires

Both include the same matchmaking wait (MATCHMAKING seconds); compare the medians side by side.
"""

from __future__ import annotations

import threading

import pytest
import torch

hivemind = pytest.importorskip("hivemind")

from diloco_core import MEAN, Merge, MergeRule, codec_for
from transports.hivemind import HivemindConfig, HivemindTransport

NUM_VALUES = 25_000_000
MATCHMAKING = 1.0
TIMEOUT = 120.0
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def _both(fns):
    out = [None] * len(fns)

    def body(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _ours(benchmark, wire: str, *, group: str, peers: int = 2, merge: Merge = MEAN, **extra) -> None:
    cfg = {
        "run_id": f"bench-{wire}-{len(extra)}",
        "host_maddrs": LOCAL,
        "matchmaking_time": MATCHMAKING,
        "averaging_timeout": TIMEOUT,
        "secret": "b",
        **extra,
    }
    # as DiLoCo does when built: the codec's CPU kernels compiled before the averagers fork (they inherit them)
    codec_for(wire).prepare(torch.empty(()).expand(NUM_VALUES), payloads=(peers,))
    first = HivemindTransport(HivemindConfig(**cfg))
    members = [first] + [HivemindTransport(HivemindConfig(**cfg, initial_peers=first.join_addresses))]
    members += [HivemindTransport(HivemindConfig(**cfg, initial_peers=first.join_addresses)) for _ in range(peers - 2)]
    shared = torch.randn(NUM_VALUES)  # as workers' pseudo-gradients: a common direction, each one's own noise
    xs = [shared + torch.randn(NUM_VALUES) for _ in members]
    try:

        def one_round():
            results = _both(
                [
                    lambda t=t, x=x: t.all_reduce([x], codec=codec_for(wire), merge=merge).wait(TIMEOUT)
                    for t, x in zip(members, xs)
                ]
            )
            assert [r.num_contributors for r in results] == [peers] * peers
            assert not any(r.left_out for r in results)

        benchmark.group = group
        benchmark.pedantic(one_round, rounds=5, warmup_rounds=1)
    finally:
        for t in members:
            t.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_ours(benchmark, wire):
    _ours(benchmark, wire, group=f"25M values, 2 peers, {wire} wire")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("wire", ["fp32", "int8", "int4", "int2", "sign", "topk"])
def test_ours_wires(benchmark, wire):
    """Our wires against our fp32 round; a group forms as soon as both peers are in (target_group_size=2),
    so rounds do not wait out matchmaking_time and the ratio is the wire's."""
    _ours(benchmark, wire, group="25M values, 2 peers, our wires, target_group_size=2", target_group_size=2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_raw_hivemind_baseline(benchmark, wire):
    from hivemind.compression import Float16Compression, NoCompression

    compression = Float16Compression() if wire == "fp16" else NoCompression()
    dht_a = hivemind.DHT(start=True, host_maddrs=LOCAL)
    dht_b = hivemind.DHT(start=True, host_maddrs=LOCAL, initial_peers=[str(m) for m in dht_a.get_visible_maddrs()])
    averagers = [
        hivemind.averaging.DecentralizedAverager(
            [torch.randn(NUM_VALUES)],
            dht,
            start=True,
            prefix=f"raw_{wire}",
            min_group_size=2,
            min_matchmaking_time=MATCHMAKING,
            request_timeout=min(3.0, MATCHMAKING / 3),
            allreduce_timeout=TIMEOUT,
            next_chunk_timeout=TIMEOUT / 4,
            compression=compression,
        )
        for dht in (dht_a, dht_b)
    ]
    try:

        def one_round():
            out = _both([lambda av=av: av.step(timeout=2 * MATCHMAKING, allow_retries=False) for av in averagers])
            assert all(o is not None and len(o) == 2 for o in out)

        benchmark.group = f"25M values, 2 peers, {wire} wire"
        benchmark.pedantic(one_round, rounds=5, warmup_rounds=1)
    finally:
        for av in averagers:
            av.shutdown()
        dht_b.shutdown()
        dht_a.shutdown()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("wire", ["fp32", "int4"])
@pytest.mark.parametrize("rule", ["mean", "robust"])
def test_ours_three_peers_robust_merge(benchmark, wire, rule):
    """The robust merge's cost on a whole round: 3 peers (where it judges), its plain mean beside its robust
    merge of honest contributions (nothing left out), per wire."""
    group = f"25M values, 3 peers, {wire} wire, plain and robust merge"
    merge = Merge(rule=MergeRule(rule))
    _ours(benchmark, wire, group=group, peers=3, merge=merge, target_group_size=3)

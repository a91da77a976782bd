"""One outer round (pseudo-gradient, in-process mean over 2 workers, Nesterov step, copy back) on a
25M-parameter model, beside the bytes-moved floor: plain memory copies of the same traffic.

    python -m pytest bench/test_bench_core.py --benchmark-only

Floor: per worker a round must at least read global and local and write the pseudo-gradient (3N),
read the mean into place (2N), read gradient, momentum and param and write momentum and param (5N),
and copy the result into the model (2N): 12N values; the mean itself reads 2N and writes N once.
So the floor is 27N values of traffic over 2 workers, timed as two threads that each copy 6.75N
values (one ``copy_`` of 6.75N reads 6.75N and writes 6.75N).
"""

from __future__ import annotations

import threading

import pytest
import torch

from diloco_core import FP16, ContributionGuard, DiLoCo, DiLoCoConfig, Merge, MergeRule, codec_for
from transports import InProcessGroup

N = 25_000_000
WORKERS = 2


def _in_threads(fns) -> None:
    """One thread per worker, each with one intra-op thread: 2 workers on 2 cores, no oversubscription."""

    def single(fn):
        torch.set_num_threads(1)
        fn()

    threads = [threading.Thread(target=single, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Big(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # a few large matrices and some small vectors, like a transformer's parameter list
        self.mats = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(2500, 2000) * 0.01) for _ in range(5)])
        self.vecs = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(2000)) for _ in range(8)])


@pytest.fixture(scope="module")
def workers():
    group = InProcessGroup(WORKERS)
    built: list = [None] * WORKERS

    def build(rank: int) -> None:
        model = Big()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        built[rank] = DiLoCo(model, opt, group.transport(rank), DiLoCoConfig(inner_steps=1))

    _in_threads([lambda r=r: build(r) for r in range(WORKERS)])
    for dl in built:  # local progress, so the pseudo-gradients are not zero
        with torch.no_grad():
            for p in dl.params:
                p.add_(0.001)
    assert sum(p.numel() for p in built[0].params) == 5 * 2500 * 2000 + 8 * 2000
    return built


def test_outer_round_25m(benchmark, workers):
    benchmark.group = "outer round, 25M params, 2 in-process workers"
    benchmark.pedantic(lambda: _in_threads([dl.sync for dl in workers]), rounds=8, warmup_rounds=2)


def test_bytes_moved_floor_baseline(benchmark):
    benchmark.group = "outer round, 25M params, 2 in-process workers"
    n = int(6.75 * N)
    bufs = [(torch.ones(n), torch.empty(n)) for _ in range(WORKERS)]
    benchmark.pedantic(lambda: _in_threads([lambda s=s, d=d: d.copy_(s) for s, d in bufs]), rounds=8, warmup_rounds=2)


def test_contribution_guard_25m(benchmark):
    """What the contribution guard adds to a round, alone, on each of 2 workers: an fp16 wire and the norm
    guard on (its references set). The norms it reads are the round's own diagnostics, computed with or
    without it; a norm past fp16's largest value would add one pass (amax, amin) over the values. Issue 13's
    budget: < 2% of a round."""
    benchmark.group = "outer round, 25M params, 2 in-process workers"
    guards = [ContributionGuard(FP16, norm_clip=4.0, numel=N) for _ in range(WORKERS)]
    bufs = [torch.randn(N + g.tail_size) * 1e-3 for g in guards]

    def one(guard: ContributionGuard, flat: torch.Tensor) -> None:
        guard.ref_norm, guard.means = 10.0, [10.0]
        excluded, _, sent = guard.admit(flat[:N], 1.0)
        guard.mark(flat, excluded=excluded, norm=sent, global_flat=flat[:N])
        norm = guard.settle(flat, 2).norm
        guard.clip_mean(flat[:N], mean_norm=1.0, contributors_norm=norm)

    benchmark.pedantic(lambda: _in_threads([lambda g=g, b=b: one(g, b) for g, b in zip(guards, bufs)]), rounds=8)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
@pytest.mark.parametrize("rule", ["mean-baseline", "robust"])
def test_merge_of_3_contributions_25m(benchmark, codec, rule):
    """The merge a member runs on 3 received payloads of 25M values, one thread: the plain mean (baseline) and
    the robust rule on honest contributions (the contributions' Gram matrix, from their values decoded piece by
    piece, then the same mean). Issue 29's budget is on a round's time: this is its worst case, the merge alone."""
    benchmark.group = f"merge of 3 contributions, 25M values, {codec}"
    c = codec_for(codec)
    shared = torch.randn(N)
    payloads = [c.encode(shared + torch.randn(N)) for _ in range(3)]
    c.prepare(shared, payloads=(3,))
    merge, out = Merge(rule=MergeRule(rule.removesuffix("-baseline"))), torch.empty(N)
    torch.set_num_threads(1)
    assert merge.of(payloads, codec=c, out=out) == ()
    benchmark.pedantic(lambda: merge.of(payloads, codec=c, out=out), rounds=5, warmup_rounds=1)

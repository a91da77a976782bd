"""A forked child (hivemind's averager) gives back the parent's tensors it inherited: the parent's
writes after the fork no longer leave the child holding the old pages; its shared and small tensors
stay."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest
import torch

from transports.hivemind.forked import MIN_BYTES, forking, release_inherited

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise")

MIB = 2**20
VALUES = 16 * MIB  # 64 MiB of fp32


def _private_kib(pid: int) -> int:
    """The process's private memory (``Private_Clean + Private_Dirty``), KiB."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return fields["Private_Clean"] + fields["Private_Dirty"]


def _child(ready, done, report, shared: torch.Tensor, small: torch.Tensor) -> None:
    torch.set_num_threads(1)  # as the averager does: a fork's OpenMP pool would hang
    report.put(release_inherited())  # as start_child does
    ready.set()
    done.wait(60)  # the parent rewrites its tensors meanwhile, then measures this process
    report.put((float(shared.sum()), float(small.sum())))


def _child_keeps(release: bool) -> tuple[int, int, tuple[float, float]]:
    """KiB the child's private memory grew by while the parent rewrote a 64 MiB tensor and its
    gradient (the old pages it kept), the bytes it gave back, and the sums of its shared and small
    tensors as it read them."""
    ctx = mp.get_context("fork")
    param = torch.nn.Parameter(torch.ones(VALUES))
    param.grad = torch.ones(VALUES)
    shared = torch.full((VALUES // 4,), 2.0).share_memory_()
    small = torch.full((MIN_BYTES // 8,), 3.0)
    ready, done, report = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child, args=(ready, done, report, shared, small))
    with forking(walk=release):  # as a peer forks its DHT and averagers (release_inherited)
        child.start()
    try:
        given = report.get(timeout=60)
        assert ready.wait(60)
        kib = -_private_kib(child.pid)
        with torch.no_grad():
            param.add_(1.0)
            param.grad.add_(1.0)
        kib += _private_kib(child.pid)
        done.set()
        sums = report.get(timeout=60)
    finally:
        done.set()
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(10)
    assert child.exitcode == 0
    return kib, given, sums


def test_a_forked_child_gives_back_the_parents_tensors_and_keeps_its_shared_and_small_ones():
    before_kib, before_given, before_sums = _child_keeps(release=False)
    after_kib, given, sums = _child_keeps(release=True)
    # without it the child keeps the old pages of both 64 MiB tensors the parent rewrote
    assert before_kib > 120 * 1024, before_kib
    assert before_given == 0
    assert given >= 2 * VALUES * 4 - 4 * 4096  # the parameter and its gradient, whole pages
    assert after_kib < 8 * 1024, (before_kib, after_kib)
    assert sums == before_sums == (2.0 * (VALUES // 4), 3.0 * (MIN_BYTES // 8))

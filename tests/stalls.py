"""Rounds with stalls: DiLoCo on one member's transport, where a member sleeps before some rounds (a quorum's
tests, in-process and hivemind)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from diloco_core import DiLoCo, DiLoCoConfig, Transport


def stalled_rounds(
    transport: Transport,
    *,
    rank: int,
    grad: Callable[[int], torch.Tensor],
    stall: dict[tuple[int, int], float],
    rounds: int,
    reduce_timeout: float,
) -> tuple[torch.Tensor, list]:
    """DiLoCo with one inner SGD step per round on the constant gradient ``grad(rank)``; before round r, member
    ``rank`` sleeps ``stall.get((rank, r))`` seconds: (global params, each round's (contributors, absent,
    seconds its step took), or None where its round was dropped)."""
    n = grad(rank).numel()
    model = torch.nn.Linear(1, n, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, merge="mean", reduce_timeout=reduce_timeout)
    dl = DiLoCo(model, opt, transport, config)
    out = []
    for r in range(1, rounds + 1):
        time.sleep(stall.get((rank, r), 0.0))
        model.weight.grad = grad(rank).view(n, 1)
        start = time.monotonic()
        report = dl.step()
        took = time.monotonic() - start
        out.append(None if report is None else (report.num_contributors, report.absent, took))
    return dl.global_params[0].clone(), out

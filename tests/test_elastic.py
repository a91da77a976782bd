"""Elastic rounds (issue 28): rounds that end by time, each worker's pseudo-gradient weighted by its work.

Each worker's clock is its own fake one (``DiLoCo(clock=...)``), advanced by its step time before every step:
a worker twice as fast takes twice the steps in a round, whatever the machine's load.
"""

from __future__ import annotations

import math

import pytest
import torch
from world import RankError

from diloco_core import DiLoCo, DiLoCoConfig
from diloco_core.guard import MAX_WORK

pytestmark = pytest.mark.timeout(180)

N = 40  # values per worker: ones to a pseudo-gradient of a known direction
ROUND_SECONDS = 1.0
H = 2  # the nominal steps of a round: a worker at 0.5 s per step does a round's work
STEP_SECONDS = (0.5, 0.25, 1.0)  # per rank: 2, 4 and 1 steps per round, work 1, 2 and 0.5


def _grad(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(N, generator=g) * 0.01 + 0.02 * (rank + 1)


def _run(transport, codec: str, timed: bool, step_seconds: tuple[float, ...], rounds: int = 2):
    """Train a vector with SGD(lr=1) on a constant gradient per rank until ``rounds`` outer rounds are done:
    (the global params, each round's (steps, work, total work, valid contributors))."""
    rank = transport.rank
    model = torch.nn.Linear(1, N, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    now = [0.0]
    settings = {"inner_steps": H, "outer_lr": 1.0, "outer_momentum": 0.0, "codec": codec, "merge": "mean"}
    config = DiLoCoConfig(**settings, round_seconds=ROUND_SECONDS if timed else None, reduce_timeout=60.0)
    dl = DiLoCo(model, opt, transport, config, clock=lambda: now[0])
    reports, steps = [], 0
    while dl.round < rounds and steps < 50:
        now[0] += step_seconds[rank % len(step_seconds)]
        model.weight.grad = _grad(rank).view(N, 1)
        report = dl.step()
        steps += 1
        if report is not None:
            reports.append((report.inner_steps, report.work, report.total_work, report.valid_contributors))
    return dl.global_params[0].clone(), reports


def _expected(world_size: int, rounds: int) -> torch.Tensor:
    """The work-weighted mean's outer steps, in float64: each round, worker r moves by steps_r * g_r and weighs
    steps_r / H."""
    steps = [round(ROUND_SECONDS / STEP_SECONDS[r]) for r in range(world_size)]
    weights = [s / H for s in steps]
    mean = sum(w * s * _grad(r).double() for r, (w, s) in enumerate(zip(weights, steps))) / sum(weights)
    return 1.0 - rounds * mean


def _runs(world, *args) -> list:
    """``_run(*args)`` on every rank; hivemind's peers afresh (a transport serves one DiLoCo)."""
    fresh = {} if world.capabilities.fixed_ranks else {"fresh": True}
    return _ok(world.run(_run, *args, timeout=120, **fresh))


def _ok(results: list) -> list:
    errors = [r for r in results if isinstance(r, RankError)]
    assert not errors, errors
    return results


def test_rounds_by_time_merge_each_workers_pseudo_gradient_by_its_work(world):
    n = world.world_size
    results = _runs(world, "fp32", True, STEP_SECONDS)
    want = _expected(n, rounds=2)
    total = sum(round(ROUND_SECONDS / STEP_SECONDS[r]) / H for r in range(n))
    for rank, (params, reports) in enumerate(results):
        steps = round(ROUND_SECONDS / STEP_SECONDS[rank])
        assert [(s, w) for s, w, _, _ in reports] == [(steps, steps / H)] * 2
        assert all(t == pytest.approx(total, rel=1e-6) and v == n for _, _, t, v in reports)
        # a hivemind cast's mean comes back rounded to the wire once more (fp32 here: nothing)
        torch.testing.assert_close(params.double().view(-1), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_equal_work_by_time_is_lock_step_bit_for_bit(world, codec):
    """Every worker at a nominal round's steps: the weights are all 1 and the result is lock-step's, bit for bit."""
    lock = _runs(world, codec, False, (0.5,))
    timed = _runs(world, codec, True, (0.5,))
    for (p, _), (q, reports) in zip(lock, timed):
        assert torch.equal(p, q)
        assert [r[:2] for r in reports] == [(H, 1.0)] * 2


def test_work_is_capped_and_round_seconds_needs_blocking_rounds():
    from transports import InProcessGroup

    model = torch.nn.Linear(1, 4, bias=False)
    now = [0.0]
    config = DiLoCoConfig(inner_steps=1, round_seconds=10.0, outer_lr=1.0)
    dl = DiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.1), InProcessGroup(1).transport(0), config, clock=lambda: now[0]
    )
    reports = []
    for _ in range(20):  # 10 steps per round at H = 1: work 10, capped
        now[0] += 1.0
        model.weight.grad = torch.ones(4, 1)
        reports.append(dl.step())
    done = [r for r in reports if r is not None]
    assert [r.inner_steps for r in done] == [10, 10] and all(r.work == MAX_WORK for r in done)
    with pytest.raises(ValueError, match=r"round_seconds=5 ends rounds by time, but overlap='eager'"):
        DiLoCoConfig(round_seconds=5.0, overlap="eager")
    with pytest.raises(ValueError, match=r"round_seconds=-1.0 is invalid: expected a finite number of seconds > 0"):
        DiLoCoConfig(round_seconds=-1.0)
    assert math.isfinite(done[0].total_work)

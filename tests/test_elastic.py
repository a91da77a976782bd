"""Elastic rounds (issue 28): rounds that end by time, each worker's pseudo-gradient weighted by its work.

Each worker's clock is its own fake one (``DiLoCo(clock=...)``), advanced by its step time before every step:
a worker twice as fast takes twice the steps in a round, whatever the machine's load.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from stalls import stalled_rounds
from threads import in_threads
from world import RankError

import diloco_core.run_state
from diloco_core import DiLoCo, DiLoCoConfig
from diloco_core.guard import MAX_WORK
from transports import InProcessConfig, InProcessGroup, transport_spec
from transports.quorum import MIN_GRACE, SLACK_FACTOR, Grace, Quorum

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


# -- quorum and grace window (in-process) ---------------------------------------------------------------------


def test_the_grace_window_follows_the_measured_slack_up_to_its_bound():
    grace = Grace(Quorum(members=2, grace_seconds=2.0))
    assert grace.window("k") == 2.0  # nothing measured yet: the bound
    for slack in (0.01, 0.02, 0.01):
        grace.full_round("k", slack)
    assert grace.window("k") == pytest.approx(max(MIN_GRACE, SLACK_FACTOR * 0.01))
    grace.full_round("other", 5.0)
    assert grace.window("other") == 2.0 and grace.window("k") < 0.1


def test_a_round_closes_without_a_stalled_worker_which_takes_its_result_and_stays_in_phase():
    group = InProcessGroup(3, quorum=Quorum(members=2, grace_seconds=0.5))
    results: list = [None] * 3

    def body(rank: int) -> None:
        # rank 2 stalls before round 2 and misses it; the others then pause before round 3, where it meets them
        stall = {(2, 2): 2.0, (0, 3): 3.0, (1, 3): 3.0}
        transport = group.transport(rank)
        results[rank] = stalled_rounds(transport, rank=rank, grad=_grad, stall=stall, rounds=4, reduce_timeout=30.0)
        transport.close()

    in_threads(body, 3, timeout=60)
    params = [p for p, _ in results]
    assert all(torch.equal(params[0], p) for p in params[1:])  # the late worker applied the same rounds
    for rank, (_, timed) in enumerate(results):
        out = [o[:2] for o in timed]
        assert out[0] == (3, ()) and out[2:] == [(3, ()), (3, ())], out
        assert out[1] == (2, ("rank 2",)), out  # round 2 closed without it; its own report names it too
    # the result is the mean of ranks 0 and 1 in round 2: the stalled worker's pseudo-gradient was dropped
    moves = [sum(_grad(r) for r in range(3)) / 3, (_grad(0) + _grad(1)) / 2]
    want = 1.0 - (3 * moves[0] + moves[1])
    torch.testing.assert_close(params[0].view(-1), want, rtol=1e-6, atol=1e-6)


def test_quorum_settings_are_checked_with_their_names():
    with pytest.raises(ValueError, match=r"quorum=-1 is invalid: expected an integer >= 0"):
        InProcessConfig(quorum=-1)
    with pytest.raises(ValueError, match=r"\[transport\] quorum=-2 is invalid"):
        transport_spec({"kind": "inprocess", "quorum": -2})
    with pytest.raises(ValueError, match=r"grace_seconds=0 is invalid: expected a finite number of seconds > 0"):
        transport_spec({"kind": "inprocess", "grace_seconds": 0})
    assert transport_spec({"kind": "inprocess", "quorum": 3, "grace_seconds": 2.0}).threads


# -- the trainer: rounds by time keep its steps, evals, checkpoints and resume keyed by the run's progress ------


@pytest.mark.timeout(180)
def test_a_timed_run_stops_checkpoints_and_resumes_by_rounds(tmp_path):
    from runs import FAST

    from diloco_train.cli import main
    from diloco_train.report.plot import read_metrics

    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", "train.checkpoint_every=1"]
    timed = ["--set", "diloco.round_seconds=0.3", "--set", "train.speeds=[1, 0.5]", "--set", "train.ddp_warm_start=0"]
    assert main(["train", "--name", "r", "-q", *common, *timed, "--set", "train.stop_after=6"]) == 0
    first = read_metrics(tmp_path / "r")
    assert [r["round"] for r in first if r["type"] == "round"] == [1, 2]
    assert main(["train", "--name", "r", "--resume", "-q", "--set", f"train.runs_dir={tmp_path!s}"]) == 0
    records = read_metrics(tmp_path / "r")
    rounds = [r for r in records if r["type"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]  # 12 nominal steps of 3 per round, resumed after round 2
    assert [r["step"] for r in records if r["type"] == "eval"] == [0, 3, 6, 9, 12]  # once per round, not per step
    assert all(r["work"] == pytest.approx(min(MAX_WORK, r["inner_steps"] / 3)) for r in rounds)
    assert all(r["total_work"] > r["work"] for r in rounds)  # the slower worker's work counts too
    summary = records[-1]
    assert summary["type"] == "summary" and summary["step"] == 12 and 0 < summary["goodput"] <= 1


@pytest.mark.timeout(120)
def test_honest_workers_that_take_a_few_steps_of_a_long_nominal_round_are_never_named(tmp_path):
    """Rounds by time with ``inner_steps = 1000``: each worker takes tens of steps a round, so it
    claims a work of a few hundredths. Before, the merge took any claim under 1 / ``MAX_WORK`` for
    an insider's: it raised every honest claim to 0.25 and named every worker (the ``150m`` preset
    on hivemind: work 0.2 claimed, 0.25 counted, both peers named in every round)."""
    from runs import FAST

    from diloco_train.cli import main
    from diloco_train.report.plot import read_metrics

    long = ["--set", "diloco.inner_steps=1000", "--set", "train.steps=3000"]
    long += ["--set", "train.eval_every=1000"]
    timed = ["--set", "diloco.round_seconds=0.3", "--set", "train.ddp_warm_start=0"]
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, *long, *timed]
    assert main(["train", "--name", "few", "-q", *common, "--set", "train.checkpoint_every=0"]) == 0
    rounds = [r for r in read_metrics(tmp_path / "few") if r["type"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["work"] < 1 / MAX_WORK for r in rounds), [r["work"] for r in rounds]
    assert all(r["left_out"] == [] for r in rounds), [r["left_out"] for r in rounds]
    # the two workers' claims, as they made them (each about the other's: the same speed)
    assert all(r["total_work"] == pytest.approx(2 * r["work"], rel=0.5) for r in rounds)


def test_a_peer_that_loads_a_timed_rounds_state_ends_its_round_with_the_round_it_joined(
    monkeypatch: pytest.MonkeyPatch,
):
    """A peer that took a state (a late peer catching up, a joiner) ends its round when the round it joined
    ends, not ``round_seconds`` after it loaded it: else it is late again at the next round. The loader
    reads the wall clock (the round's end is compared across machines): it is held at the source
    round's end, so that the state's age is the one each case gives (a loaded machine took over 0.25
    s between the round and the load once, and the case of 0 s ended its round 2 steps early)."""

    def timed(now: list[float]) -> DiLoCo:
        model = torch.nn.Linear(1, N, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        config = DiLoCoConfig(inner_steps=4, outer_momentum=0.0, round_seconds=1.0, reduce_timeout=30.0)
        return DiLoCo(model, opt, InProcessGroup(1).transport(0), config, clock=lambda: now[0])

    def steps_to_round(dl: DiLoCo, now: list[float]) -> int:
        for steps in range(1, 20):
            now[0] += 0.25
            dl.model.weight.grad = _grad(0).view(N, 1)
            if (report := dl.step()) is not None:
                return report.inner_steps
        raise AssertionError("no round")

    source_clock = [0.0]
    source = timed(source_clock)
    assert steps_to_round(source, source_clock) == 4
    meta, tensors = source.run_state.snapshot()
    held = types.SimpleNamespace(time=lambda: meta["ended_at"])
    monkeypatch.setattr(diloco_core.run_state, "time", held)
    for ago, steps in ((0.6, 2), (0.0, 4), (30.0, 1)):  # long ago: at most a round ago (its bound)
        peer_clock = [100.0]
        peer = timed(peer_clock)
        torch._foreach_copy_(peer.global_params, source.global_params)
        peer.run_state.loader({**meta, "ended_at": meta["ended_at"] - ago}, tensors)()
        assert steps_to_round(peer, peer_clock) == steps, ago

"""DiLoCoOptimizer: DiLoCo behind the optimizer surface, bit for bit the same as ``DiLoCo.step()``."""

from __future__ import annotations

import io

import pytest
import torch
from test_diloco import _loss, _model
from threads import run_threads

from diloco_core import DiLoCo, DiLoCoConfig, DiLoCoOptimizer, Transport

pytestmark = pytest.mark.timeout(60)

CONFIG = DiLoCoConfig(inner_steps=3)


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))


def _everything(dl: DiLoCo) -> list[torch.Tensor]:
    momentum = [s["momentum_buffer"] for s in dl.outer_optimizer.state.values()]
    adam = [t for s in dl.inner_optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [t.detach().clone() for t in [*dl.model.parameters(), *dl.global_params, *momentum, *adam]]


def _with_diloco_step(t: Transport, steps: int = 9) -> tuple[list[torch.Tensor], list[float]]:
    model = _model(seed=t.rank)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl, sched = DiLoCo(model, inner, t, CONFIG), _schedule(inner)
    for step in range(steps):
        _loss(model, t.rank, step).backward()
        dl.step()
        inner.zero_grad()
        sched.step()
    return _everything(dl), [g["lr"] for g in inner.param_groups]


def _with_optimizer(t: Transport, steps: int = 9) -> tuple[list[torch.Tensor], list[float]]:
    model = _model(seed=t.rank)
    opt = DiLoCoOptimizer(DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), t, CONFIG))
    sched = _schedule(opt)  # on the wrapper: its learning rate must reach the inner AdamW
    for step in range(steps):
        _loss(model, t.rank, step).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.last_report is not None and opt.last_report.round == steps // CONFIG.inner_steps
    return _everything(opt.diloco), [g["lr"] for g in opt.diloco.inner_optimizer.param_groups]


def test_the_optimizer_and_a_scheduler_on_it_are_bit_identical_to_diloco_step_on_two_threads():
    ref, got = run_threads(2, _with_diloco_step), run_threads(2, _with_optimizer)
    for (ref_state, ref_lr), (state, lr) in zip(ref, got):
        assert lr == ref_lr == [1e-2 / 10]
        assert len(state) == len(ref_state) and all(torch.equal(a, b) for a, b in zip(state, ref_state))
    shared = 2 * len(list(_model().parameters()))  # the model and the global copy, after the last round
    assert all(torch.equal(a, b) for a, b in zip(got[0][0][:shared], got[1][0][:shared]))


def test_state_dict_round_trip_resumes_bit_identically_and_the_scheduler_still_reaches_the_inner_optimizer():
    def worker(t: Transport) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = _model(seed=t.rank)
        opt = DiLoCoOptimizer(DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), t, CONFIG))
        sched = _schedule(opt)

        def train(steps: range) -> None:
            for step in steps:
                _loss(opt.diloco.model, t.rank, step).backward()
                opt.step()
                opt.zero_grad()
                sched.step()

        train(range(6))
        buf = io.BytesIO()
        torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
        train(range(6, 12))
        straight = _everything(opt.diloco)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)  # as HF Trainer and Lightning load checkpoints
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        assert opt.diloco.round == 2 and opt.param_groups is opt.diloco.inner_optimizer.param_groups
        train(range(6, 12))
        assert opt.diloco.inner_optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 13)
        return straight, _everything(opt.diloco)

    for straight, resumed in run_threads(2, worker):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_a_closure_is_called_once_before_the_inner_step_and_its_loss_returned():
    model = _model()
    from transports import InProcessGroup

    opt = DiLoCoOptimizer(
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), InProcessGroup(1).transport(0), CONFIG)
    )
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        opt.zero_grad()
        loss = _loss(model, 0, 0)
        loss.backward()
        return loss

    with torch.no_grad():  # as Lightning calls it: the closure still builds a graph
        loss = opt.step(closure)
    assert calls == [1] and loss.item() == pytest.approx(_loss(_model(), 0, 0).item())
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert isinstance(opt, torch.optim.Optimizer) and opt.diloco.inner_step == 1

"""The whole model state: frozen parameters and buffers broadcast at start, floating buffers averaged every
round and checkpointed, parameters matched by name (issue 13, "Whole model state")."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from world import RankError, make_world

from diloco_core import FP32, MEAN, DiLoCo, DiLoCoConfig, Transport, reference_mean
from transports import InProcessGroup

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    """A frozen input layer, then a trainable layer with BatchNorm: frozen params, float and int buffers."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # not torch's global RNG: ranks may be threads that share it
        self.frozen = torch.nn.Linear(6, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 2)
        self.register_buffer("cache", torch.full((3,), float(seed)), persistent=False)  # derived: left alone
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
            self.bn.running_mean.copy_(torch.randn(8, generator=g))
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.hidden(torch.tanh(self.frozen(x))))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 6, generator=g) * (1 + rank), torch.randn(16, 2, generator=g)


def _build(t: Transport, wire_dtype: str = "fp32") -> tuple[Net, torch.optim.Optimizer, DiLoCo]:
    model = Net(seed=t.rank)  # every rank starts different, frozen layer and buffers included
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    cfg = DiLoCoConfig(inner_steps=2, outer_lr=0.7, codec=wire_dtype, reduce_timeout=30)
    return model, opt, DiLoCo(model, opt, t, cfg)


def _train(model: Net, opt: torch.optim.Optimizer, dl: DiLoCo, rank: int, steps: range) -> list:
    """Train; after each round, this rank's buffers before the round (what it sent) and after it."""
    rounds = []
    for step in steps:
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        sent = [b.clone() for b in (model.bn.running_mean, model.bn.running_var)]
        if dl.step() is not None:
            rounds.append((sent, [b.clone() for b in (model.bn.running_mean, model.bn.running_var)]))
        opt.zero_grad()
    return rounds


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _start_and_train(t: Transport, wire_dtype: str) -> tuple:
    model, opt, dl = _build(t, wire_dtype)
    at_start = _state(model)
    rounds = _train(model, opt, dl, t.rank, range(6))
    return at_start, rounds, _state(model), model.cache.clone(), dl.state_dict().get("model_state", {})


@pytest.fixture(params=["inprocess", "torch"])
def world(request, tmp_path):
    w = make_world(request.param, 2, str(tmp_path))
    yield w
    w.close()


@pytest.mark.parametrize("wire_dtype", ["fp32", "int8"])  # buffers travel in fp32 whatever the codec
def test_frozen_params_and_buffers_start_equal_and_float_buffers_are_averaged_every_round(world, wire_dtype):
    results = world.run(functools.partial(_start_and_train, wire_dtype=wire_dtype))
    assert not any(isinstance(r, RankError) for r in results), results
    (start0, rounds0, end0, cache0, saved0), (start1, rounds1, end1, cache1, _) = results
    want = Net(seed=0).state_dict()
    for name in start0:  # rank 0's everything: frozen layer, trainable layers, BatchNorm's buffers
        assert torch.equal(start0[name], want[name]) and torch.equal(start1[name], want[name]), name
    assert len(rounds0) == len(rounds1) == 3
    for (sent0, got0), (sent1, got1) in zip(rounds0, rounds1):
        for a, b, mine, theirs in zip(sent0, sent1, got0, got1):
            assert not torch.equal(a, b)  # the ranks' statistics differed before the round
            assert torch.equal(mine, theirs) and torch.equal(mine, reference_mean([a, b], FP32))
    for name in end0:  # num_batches_tracked counts the same steps everywhere
        assert torch.equal(end0[name], end1[name]), name
    assert torch.equal(end0["frozen.weight"], want["frozen.weight"])  # frozen: never moved
    assert cache0.tolist() == [0.0] * 3 and cache1.tolist() == [1.0] * 3  # non-persistent: left alone
    assert sorted(saved0) == [
        "bn.num_batches_tracked",
        "bn.running_mean",
        "bn.running_var",
        "frozen.bias",
        "frozen.weight",
    ]
    assert torch.equal(saved0["bn.running_var"], end0["bn.running_var"])


def _build_swapped(t: Transport) -> None:
    model = torch.nn.Module()
    for name in ("a", "b") if t.rank == 0 else ("b", "a"):  # the same shapes, registered in another order
        model.add_module(name, torch.nn.Linear(4, 4))
    DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), t, DiLoCoConfig(reduce_timeout=30))


def test_same_shapes_registered_in_another_order_are_refused_on_every_rank_by_name(world):
    r0, r1 = world.run(_build_swapped)
    assert isinstance(r0, RankError) and isinstance(r1, RankError), (r0, r1)
    assert r0.type == r1.type == "ValueError"
    assert "1 rank(s) have a model that differs from rank 0's, first at rank 0's 'a.weight'" in r0.message
    assert "rank 1's model differs from rank 0's at 'b.weight'" in r1.message
    assert "vs 'a.weight' (trainable, shape (4, 4), torch.float32) on rank 0" in r1.message


def test_a_buffer_dtype_that_differs_is_refused():
    def build(t: Transport) -> None:
        model = Net(seed=0)
        if t.rank == 1:
            model.bn.running_var = model.bn.running_var.double()
        DiLoCo(model, torch.optim.SGD(model.out.parameters(), lr=0.1), t, DiLoCoConfig(reduce_timeout=30))

    r0, r1 = make_world("inprocess", 2, "").run(build)
    assert "first at rank 0's 'bn.running_var' (buffer, shape (8,), torch.float32)" in r0.message
    assert "'bn.running_var' (buffer, shape (8,), torch.float64) here" in r1.message


def test_a_parameter_unfrozen_after_construction_is_a_clear_error_before_anything_changes():
    model, opt, dl = _build(InProcessGroup(1).transport(0))
    _train(model, opt, dl, 0, range(2))
    model.frozen.weight.requires_grad_(True)
    before = _state(model)
    with pytest.raises(
        ValueError, match="parameter 'frozen.weight' is trainable now but was not when DiLoCo was built"
    ):
        dl.sync()
    assert all(torch.equal(v, before[k]) for k, v in _state(model).items()) and dl.round == 1


def test_resume_restores_buffers_and_frozen_params_bit_identically():
    saved: dict[int, bytes] = {}

    def uninterrupted(t: Transport):
        model, opt, dl = _build(t)
        _train(model, opt, dl, t.rank, range(5))  # two rounds and one step
        buf = io.BytesIO()
        torch.save(dl.state_dict(), buf)
        saved[t.rank] = buf.getvalue()
        _train(model, opt, dl, t.rank, range(5, 11))
        return _state(model)

    def resumed(t: Transport):
        model, opt, dl = _build(t)
        with torch.no_grad():  # as if the run had started again from other values
            for v in model.state_dict().values():
                v.add_(1)
        dl.load_state_dict(torch.load(io.BytesIO(saved[t.rank]), weights_only=True))
        _train(model, opt, dl, t.rank, range(5, 11))
        return _state(model)

    world = make_world("inprocess", 2, "")
    first, second = world.run(uninterrupted), world.run(resumed)
    for a, b in zip(first, second):
        assert not isinstance(a, RankError) and not isinstance(b, RankError), (a, b)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]


def test_a_state_of_another_model_is_refused_by_name_and_one_without_names_or_buffers_too():
    _, _, dl = _build(InProcessGroup(1).transport(0))
    state = dl.state_dict()
    bad = {**state, "param_names": ["hidden.weight", "bn.weight", "hidden.bias", "bn.bias", "out.weight", "out.bias"]}
    with pytest.raises(ValueError, match="trainable parameter #1 is 'bn.weight'; this model's is 'hidden.bias'"):
        dl.load_state_dict(bad)
    with pytest.raises(ValueError, match="'bn.running_var' is \\(7,\\), this model's \\(8,\\)"):
        dl.load_state_dict({**state, "model_state": {**state["model_state"], "bn.running_var": torch.ones(7)}})
    for key in ("param_names", "model_state"):  # the package was never released: no older format to accept
        with pytest.raises(ValueError, match=f"missing \\['{key}'\\]"):
            dl.load_state_dict({k: v for k, v in state.items() if k != key})


def test_a_model_without_buffers_or_frozen_params_reduces_once_per_round():
    keys: list[str] = []
    t = InProcessGroup(1).transport(0)
    reduce = t.all_reduce
    t.all_reduce = lambda tensors, *, codec=FP32, key="default", merge=MEAN: (
        keys.append(key) or reduce(tensors, codec=codec, key=key, merge=merge)
    )
    plain = torch.nn.Linear(3, 2)
    dl = DiLoCo(plain, torch.optim.SGD(plain.parameters(), lr=0.1), t, DiLoCoConfig(inner_steps=1))
    dl.sync()
    assert keys == ["diloco/check", "diloco/check", "diloco/round"]  # settings, then the model; then a round
    _, _, dl = _build(t)
    keys.clear()
    dl.sync()
    assert keys == ["diloco/round", "diloco/buffers"]

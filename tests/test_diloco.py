"""The DiLoCo round against hand-computed numbers, torch's own optimizers, and the paper's invariants."""

from __future__ import annotations

import io

import pytest
import torch
from threads import in_threads, run_threads

from diloco_core import (
    FP32,
    MEAN,
    ContributionGuard,
    DiLoCo,
    DiLoCoConfig,
    Membership,
    ReduceHandle,
    RunState,
    Transport,
    TransportError,
    codec_for,
    reference_mean,
)
from diloco_core.config import outer_lr_for
from diloco_core.guard import WINDOW
from transports import ForwardingTransport, InProcessGroup

pytestmark = pytest.mark.timeout(60)


class Scalar(torch.nn.Module):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(values))


def move_to(model: Scalar, opt: torch.optim.Optimizer, target: list[float]) -> None:
    """One inner SGD(lr=1) step that lands exactly on ``target``."""
    model.w.grad = model.w.detach() - torch.tensor(target)


def test_outer_step_matches_hand_computed_nesterov_and_sign_is_old_minus_new():
    # Two workers start at [1, 2] and move to [0.5, 2.5] and [0.7, 2.1]: pseudo-grads [0.5, -0.5] and
    # [0.3, -0.1] (old - new), mean [0.4, -0.3]. Nesterov, lr 0.7, momentum 0.9, first step:
    # buf = g, update = g + 0.9 * buf = 1.9 g, new = old - 0.7 * 1.9 g = [1 - 0.532, 2 + 0.399].
    targets = [[0.5, 2.5], [0.7, 2.1]]

    def worker(t: Transport):
        model = Scalar([1.0, 2.0])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, outer_lr=0.7, outer_momentum=0.9))
        move_to(model, opt, targets[t.rank])
        report = dl.step()
        after_one = model.w.detach().clone()
        move_to(model, opt, [x + 0.1 for x in targets[t.rank]])
        dl.step()
        return report, after_one, model.w.detach().clone()

    (r0, one0, two0), (_, one1, two1) = run_threads(2, worker)
    assert r0.round == 1 and r0.num_contributors == 2
    torch.testing.assert_close(one0, torch.tensor([0.468, 2.399]), rtol=0, atol=1e-6)
    assert torch.equal(one0, one1) and torch.equal(two0, two1)

    # The same two steps through torch.optim.SGD directly, on the averaged pseudo-gradient.
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ref = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for shift in (0.0, 0.1):
        local = [torch.tensor(t) + shift for t in targets]
        start = p.detach().clone()
        p.grad = torch.stack([start - x for x in local]).mean(0)  # old - new
        ref.step()
        if shift == 0.1:
            torch.testing.assert_close(two0, p.detach(), rtol=0, atol=1e-6)


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)


def _model(seed: int = 0) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(seed)  # not torch's global RNG: ranks are threads that share it
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _data(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def test_h1_sgd_plain_averaging_equals_synchronous_data_parallel():
    steps, lr, m = 6, 0.05, 3

    def worker(t: Transport):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0))
        for step in range(steps):
            _loss(model, t.rank, step).backward()
            dl.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    results = run_threads(m, worker)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        grads = []
        for rank in range(m):
            ref.zero_grad()
            _loss(ref, rank, step).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *gs in zip(ref.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    for got in results:
        for a, b in zip(got, ref.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_single_worker_plain_averaging_equals_plain_training():
    steps = 12

    def run(with_diloco: bool) -> list[torch.Tensor]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step_fn = opt.step
        if with_diloco:
            t = InProcessGroup(1).transport(0)
            step_fn = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=4, outer_lr=1.0, outer_momentum=0.0)).step
        for step in range(steps):
            _loss(model, 0, step).backward()
            step_fn()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _state_digest(dl: DiLoCo) -> list[torch.Tensor]:
    bufs = [s["momentum_buffer"] for s in dl.outer_optimizer.state.values()]
    return [g.clone() for g in dl.global_params] + [b.clone() for b in bufs]


def test_global_state_identical_on_every_worker_after_every_round_despite_different_inits():
    def worker(t: Transport):
        model = _model(seed=t.rank)  # different random weights before construction
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=3))
        digests = [[p.detach().clone() for p in model.parameters()]]
        for step in range(12):
            _loss(model, t.rank, step).backward()
            if dl.step() is not None:
                digests.append(_state_digest(dl))
            opt.zero_grad()
        return digests

    results = run_threads(3, worker)
    assert len(results[0]) == 5
    for other in results[1:]:
        for mine, theirs in zip(results[0], other):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], _model(seed=0).parameters()))


def _train(dl: DiLoCo, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        _loss(dl.model, rank, step).backward()
        dl.step()
        opt.zero_grad()


# lossy ones with error feedback; block 16: the 74 parameters in five blocks, the last one partial
@pytest.mark.parametrize(
    "wire_dtype", ["fp32", "bf16", "int8", "int4", "int8/16", "int4/16", "int2/16", "sign/32", "topk/32"]
)
def test_resume_from_a_saved_round_is_bit_identical(wire_dtype):
    wire_dtype, _, block = wire_dtype.partition("/")
    cfg = DiLoCoConfig(inner_steps=3, codec=wire_dtype, codec_block=int(block or 256))
    saved: dict[int, bytes] = {}

    def uninterrupted(t: Transport):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dl = DiLoCo(model, opt, t, cfg)
        _train(dl, opt, t.rank, range(7))  # round 2 ends at step 6; one step into round 3
        buf = io.BytesIO()
        torch.save(dl.state_dict(), buf)
        saved[t.rank] = buf.getvalue()
        _train(dl, opt, t.rank, range(7, 15))
        return [p.detach().clone() for p in model.parameters()], _state_digest(dl)

    def resumed(t: Transport):
        model = _model(seed=42)  # fresh objects; the checkpoint overrides everything
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dl = DiLoCo(model, opt, t, cfg)
        state = torch.load(io.BytesIO(saved[t.rank]), weights_only=True)
        assert (state["residual"] is None) == (wire_dtype == "fp32")  # a residual to resume from, where lossy
        dl.load_state_dict(state)
        assert (dl.round, dl.inner_step) == (2, 7)
        _train(dl, opt, t.rank, range(7, 15))
        return [p.detach().clone() for p in model.parameters()], _state_digest(dl)

    first = run_threads(2, uninterrupted)
    second = run_threads(2, resumed)
    for (pa, sa), (pb, sb) in zip(first, second):
        assert all(torch.equal(a, b) for a, b in zip(pa + sa, pb + sb))


class FailingTransport(Transport):
    """Fault injection: delegates to ``inner`` but fails the reduce whose (1-based) number is in ``fail_at``."""

    def __init__(self, inner: Transport, fail_at: set[int], error: type[TransportError] = TransportError) -> None:
        self.inner, self.fail_at, self.calls, self.error = inner, fail_at, 0, error

    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)
    capabilities = property(lambda self: self.inner.capabilities)

    def all_reduce(self, tensors, *, codec=FP32, key="default", merge=MEAN) -> ReduceHandle:
        self.calls += 1
        if self.calls in self.fail_at:
            error = self.error

            class Failed(ReduceHandle):
                def wait(self, timeout):
                    raise error("injected failure")

            return Failed()
        return self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge)

    def broadcast(self, tensors, *, src=0, timeout):
        self.inner.broadcast(tensors, src=src, timeout=timeout)


def test_failed_reduce_changes_nothing_and_the_round_can_be_retried():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = FailingTransport(
        InProcessGroup(1).transport(0), fail_at={4}
    )  # 1, 2: settings and shape checks, 3: round 1, 4: round 2
    dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=2, round_retries=0))
    _train(dl, opt, 0, range(2))
    before = _state_digest(dl)
    _loss(model, 0, 2).backward()
    dl.step()
    opt.zero_grad()
    _loss(model, 0, 3).backward()
    local = None
    with pytest.raises(TransportError, match="injected"):
        try:
            dl.step()
        finally:
            local = [p.detach().clone() for p in model.parameters()]
    assert dl.round == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _state_digest(dl)))
    assert not all(torch.equal(a, b) for a, b in zip(local, dl.global_params))  # local progress kept
    report = dl.sync()
    assert report.round == 2 and report.num_contributors == 1


def test_models_with_different_shapes_are_refused_on_every_rank():
    def worker(t: Transport):
        width = 8 if t.rank != 2 else 9
        model = torch.nn.Linear(4, width)
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), t, DiLoCoConfig(reduce_timeout=10))

    group = InProcessGroup(3)
    errors: dict[int, str] = {}

    def body(rank: int) -> None:
        try:
            worker(group.transport(rank))
        except ValueError as e:
            errors[rank] = str(e)

    in_threads(body, 3, timeout=30, what="ranks")
    assert sorted(errors) == [0, 1, 2]
    assert (
        "rank 2's model differs from rank 0's" in errors[2]
        and "45 values here vs 2 tensors with 40 values" in errors[2]
    )
    assert "1 rank(s) have a model" in errors[0]


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("inner_steps", 0, ">= 1"),
        ("inner_steps", 2.5, "integer"),
        ("outer_lr", -0.1, "> 0"),
        ("outer_lr", float("nan"), "finite"),
        ("outer_momentum", 1.0, "[0, 1)"),
        ("nesterov", "yes", "true or false"),
        ("codec", "int3", "int8"),
        ("codec_block", 100, "a power of two in [16, 65536]"),
        ("codec_block", 2**17, "a power of two in [16, 65536]"),
        ("error_feedback", 1, "true or false"),
        ("reduce_timeout", 0, "> 0"),
        ("round_retries", -1, ">= 0"),
        ("global_device", "gpu0", "global_device"),
    ],
)
def test_bad_config_names_field_value_and_range(field, value, words):
    with pytest.raises(ValueError) as e:
        DiLoCoConfig(**{field: value})
    assert field in str(e.value) and words in str(e.value)


def test_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        DiLoCoConfig(500)  # type: ignore[misc]
    cfg = DiLoCoConfig()
    assert (cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov, cfg.codec) == (
        500,
        None,
        0.5,
        True,
        "fp32",
    )
    with pytest.raises(AttributeError):
        cfg.inner_steps = 3  # type: ignore[misc]


def test_step_retries_a_failed_round_before_giving_up():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = FailingTransport(
        InProcessGroup(1).transport(0), fail_at={3, 4, 6, 7, 8}
    )  # 1, 2: checks; round 1: 2 failures; round 2: 3
    dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, round_retries=2))
    _loss(model, 0, 0).backward()
    assert dl.step().round == 1  # the third attempt went through
    opt.zero_grad()
    _loss(model, 0, 1).backward()
    with pytest.raises(TransportError, match="injected"):
        dl.step()
    assert dl.round == 1 and t.calls == 8


def test_a_replaced_state_drops_the_round_without_retrying_it():
    from diloco_core import StateReplaced

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = FailingTransport(InProcessGroup(1).transport(0), fail_at={3}, error=StateReplaced)  # 1, 2: checks
    dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, round_retries=2))
    _loss(model, 0, 0).backward()
    assert dl.step() is None and t.calls == 3  # no retry: the transport has already loaded the group's state
    opt.zero_grad()
    _loss(model, 0, 1).backward()
    assert dl.step().round == 1


def test_the_transport_is_attached_once_the_global_params_are_in_place():
    """``attach`` is where a transport whose peers come and go (a ``Membership``) loads the run's outer state
    (hivemind); it must see the broadcast global params, and its answer becomes ``DiLoCo.joined``."""

    def build(transport: Transport) -> tuple[DiLoCo, list]:
        seen: list = []
        model = Scalar([float(transport.rank + 1), 5.0])  # different weights per rank: the broadcast fixes that

        class Joining(ForwardingTransport, Membership):  # this worker pretends to join a running run
            def attach(self, state: RunState, timeout: float) -> bool:
                seen.append((model.w.detach().clone(), state.snapshot(), timeout))
                return True

            def state_dict(self) -> dict:
                return {}

            def load_state_dict(self, state: dict) -> None:
                pass

        t = Joining(transport) if transport.rank == 1 else transport  # rank 0: no Membership, nothing attached
        dl = DiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=1.0), t, DiLoCoConfig(inner_steps=1, reduce_timeout=7)
        )
        return dl, seen

    (first, none), (joiner, seen) = run_threads(2, build)
    assert not first.joined and not none  # a fixed group's transport is not attached
    assert joiner.joined
    [(params, (meta, momentum), timeout)] = seen
    assert timeout == 7 and torch.equal(params, torch.tensor([1.0, 5.0]))  # rank 0's weights, broadcast first
    assert (
        meta
        == {"round": 0, "num_momentum": 0, "guard": {"ref_norm": 0.0, "ref_mean": 0.0, "means": []}, "ended_at": None}
        and momentum == []
    )


def _trained(rounds: int, seed: int = 0) -> tuple[DiLoCo, torch.nn.Module]:
    model = _model(seed)
    dl = DiLoCo(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        InProcessGroup(1).transport(0),
        DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9),
    )
    _train(dl, dl.inner_optimizer, 0, range(2 * rounds))
    return dl, model


def test_run_state_moves_round_and_momentum_to_another_worker_and_checks_them_first():
    source, _ = _trained(rounds=3)
    seen: list[int] = []
    source.run_state.subscribe(lambda: seen.append(source.round))
    _train(source, source.inner_optimizer, 0, range(6, 8))
    assert seen == [4]  # after the round, with the round counted
    joiner, model = _trained(rounds=0, seed=1)
    torch._foreach_copy_(joiner.global_params, source.global_params)  # what the broadcast does on a joiner
    meta, tensors = source.run_state.snapshot()
    assert meta["round"] == 4 and meta["num_momentum"] == 1 and meta["guard"] == source.guard.state_dict()
    before = joiner.state_dict()
    for bad_meta, bad in [
        ({"round": -1, "num_momentum": 1}, tensors),
        (meta, []),
        (meta, [tensors[0][:-1]]),
        (meta, [torch.full_like(tensors[0], float("nan"))]),
        ("not a dict", tensors),
    ]:
        with pytest.raises(ValueError, match="peer"):
            joiner.run_state.loader(bad_meta, bad)
    assert joiner.state_dict()["outer_optimizer"] == before["outer_optimizer"] and joiner.round == 0
    joiner.run_state.loader(meta, tensors)()
    assert (joiner.round, joiner.inner_step) == (4, 8)
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), joiner.global_params))
    # From the same state and data (and a stateless inner SGD: inner state is never shared), the same next round.
    _train(source, source.inner_optimizer, 0, range(8, 10))
    _train(joiner, joiner.inner_optimizer, 0, range(8, 10))
    assert torch.equal(source.state_dict()["global"], joiner.state_dict()["global"])


class _Tagged(ForwardingTransport, Membership):
    """A transport whose peers come and go, as far as its state goes: it keeps a tag and records loads."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.loaded: list = []

    def attach(self, state: RunState, timeout: float) -> bool:
        return False

    def state_dict(self) -> dict:
        return {"tag": (3, b"x")}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


def test_the_transports_state_travels_inside_diloco_state():
    t = _Tagged(InProcessGroup(1).transport(0))
    model = _model()
    dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), t, DiLoCoConfig(inner_steps=1))
    state = dl.state_dict()
    assert state["transport"] == {"tag": (3, b"x")}
    dl.load_state_dict(state)
    assert t.loaded == [{"tag": (3, b"x")}]  # after DiLoCo's own state: hivemind serves what was loaded
    del state["transport"]  # not a DiLoCo.state_dict(): refused, nothing loaded
    with pytest.raises(ValueError, match=r"missing \['transport'\]"):
        dl.load_state_dict(state)
    assert t.loaded == [{"tag": (3, b"x")}]


def test_a_fixed_groups_transport_keeps_no_state_in_diloco_state():
    model = _model()
    dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), InProcessGroup(1).transport(0), DiLoCoConfig())
    assert dl.state_dict()["transport"] == {}  # not a Membership: nothing to keep, and the same checkpoint keys


# -- round diagnostics: norms and agreement, against numbers computed by hand ----------------------------


def _one_round(moves: list[list[float]], wire_dtype: str = "fp32"):
    """Every worker starts at [1, 2, 2] and takes one inner SGD(lr=1) step to its ``moves`` target."""

    def worker(t: Transport):
        model = Scalar([1.0, 2.0, 2.0])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, codec=wire_dtype))
        move_to(model, opt, moves[t.rank])
        return dl.step()

    return run_threads(len(moves), worker)


def test_one_worker_agrees_with_itself_and_reports_its_norm():
    # pseudo-gradient [1, 2, 2] - [0, 0, 0] = [1, 2, 2]: norm 3.
    (report,) = _one_round([[0.0, 0.0, 0.0]])
    assert report.pseudo_grad_norm == pytest.approx(3.0, rel=1e-6)
    assert report.mean_pseudo_grad_norm == pytest.approx(3.0, rel=1e-6)
    assert report.agreement == pytest.approx(1.0, rel=1e-6)


def test_identical_workers_agree():
    reports = _one_round([[0.0, 1.0, 0.0]] * 3)  # each: [1, 1, 2], norm sqrt(6)
    for r in reports:
        assert r.pseudo_grad_norm == pytest.approx(6**0.5, rel=1e-6)
        assert r.mean_pseudo_grad_norm == pytest.approx(6**0.5, rel=1e-6)
        assert r.agreement == pytest.approx(1.0, rel=1e-6)


def test_opposite_workers_cancel_out():
    reports = _one_round([[0.0, 0.0, 0.0], [2.0, 4.0, 4.0]])  # [1, 2, 2] and [-1, -2, -2]
    assert [r.pseudo_grad_norm for r in reports] == pytest.approx([3.0, 3.0], rel=1e-6)
    for r in reports:
        assert r.mean_pseudo_grad_norm == 0.0 and r.agreement == 0.0


@pytest.mark.parametrize("wire_dtype", ["fp32", "fp16", "bf16"])
def test_orthogonal_workers_of_different_norms(wire_dtype):
    # [1, 2, 2] (norm 3) and [-3, 2, 0] (norm sqrt(13)), orthogonal: the mean [-1, 2, 1] has norm sqrt(6);
    # the contributors' mean norm is (3 + sqrt(13)) / 2. The 16-bit wires round the values (all exact
    # here) and the RMS that carries each norm (to ~3 significant digits).
    reports = _one_round([[0.0, 0.0, 0.0], [4.0, 0.0, 2.0]], wire_dtype)
    rel = 1e-6 if wire_dtype == "fp32" else 1e-2
    assert [r.pseudo_grad_norm for r in reports] == pytest.approx([3.0, 13**0.5], rel=1e-6)
    for r in reports:
        assert r.mean_pseudo_grad_norm == pytest.approx(6**0.5, rel=1e-6)
        assert r.agreement == pytest.approx(6**0.5 / ((3 + 13**0.5) / 2), rel=rel)
    assert reports[0].agreement == reports[1].agreement  # the same reduced value on every worker


# -- the outer lr when unset: chosen by the number of workers ------------------------------------------


def test_outer_lr_rule_keeps_the_effective_step_growing_slowly_with_workers():
    assert [outer_lr_for(m, 0.5) for m in (1, 2, 4, 8)] == pytest.approx([0.5, 0.6, 0.7, 0.8])
    assert outer_lr_for(1, 0.0) == 1.0  # one worker, no momentum: plain training's step
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_workers"):
            outer_lr_for(bad, 0.5)


@pytest.mark.parametrize("world_size", [1, 4])
def test_unset_outer_lr_follows_the_rule_for_the_world_size_and_a_set_one_wins(world_size):
    def worker(t: Transport):
        unset = DiLoCo(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), t, DiLoCoConfig(outer_momentum=0.5))
        given = DiLoCo(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), t, DiLoCoConfig(outer_lr=0.3))
        return unset.outer_optimizer.param_groups[0]["lr"], given.outer_optimizer.param_groups[0]["lr"]

    for unset, given in run_threads(world_size, worker):
        assert unset == pytest.approx(outer_lr_for(world_size, 0.5)) and given == 0.3


# -- a round split into begin and finish ----------------------------------------------------------------


def test_a_split_round_reduces_what_it_began_with_and_training_between_is_replaced():
    """begin_round takes the pseudo-gradient then; inner steps before finish_round change neither the
    reduce nor the outer step, and finish_round sets the model to the new global params."""

    def worker(t: Transport):
        model = Scalar([1.0, 2.0, 2.0])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0))
        move_to(model, opt, [0.0, 0.0, 0.0] if t.rank == 0 else [1.0, 1.0, 1.0])
        opt.step()
        pending = dl.begin_round()
        assert pending.round == 1 and dl.round == 0
        move_to(model, opt, [9.0, 9.0, 9.0])  # trains on while the reduce is in flight
        opt.step()
        report = dl.finish_round(pending)
        with pytest.raises(ValueError, match="pending round 1 cannot finish: this worker is at round 1"):
            dl.finish_round(pending)
        return report, [p.detach().clone() for p in model.parameters()], dl.round

    for report, params, rnd in run_threads(2, worker):
        # mean of [1, 2, 2] and [0, 1, 1] is [0.5, 1.5, 1.5]: global [1, 2, 2] - mean = [0.5, 0.5, 0.5]
        assert rnd == 1 and report.round == 1 and report.num_contributors == 2
        assert torch.equal(torch.cat([p.reshape(-1) for p in params]), torch.tensor([0.5, 0.5, 0.5]))
        assert report.mean_pseudo_grad_norm == pytest.approx((0.25 + 2.25 * 2) ** 0.5, rel=1e-6)


def test_a_reduce_timeout_shorter_than_the_transports_own_is_refused():
    t = InProcessGroup(1).transport(0)
    t.own_timeout = 120.0
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"reduce_timeout=60 is shorter than the transport's own timeout \(120s\)"):
        DiLoCo(model, opt, t, DiLoCoConfig(reduce_timeout=60))
    assert DiLoCo(model, opt, t, DiLoCoConfig(reduce_timeout=120)).config.reduce_timeout == 120


# -- error feedback: what a lossy codec drops is sent in later rounds ----------------------------------------


def _feedback_rounds(wire_dtype: str, error_feedback: bool, rounds: int = 40):
    """One worker, plain averaging (outer lr 1, no momentum), whose every round moves by the same kind of
    pseudo-gradient: per block one value of 1 and the rest 0.4 quantization steps, which a lossy codec
    alone rounds to zero every time. Returns (fp64 sum of the pseudo-gradients, fp64 sum of the updates
    applied, the DiLoCo)."""
    n, g = 1000, torch.Generator().manual_seed(0)
    model = Scalar([0.0] * n)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, codec=wire_dtype, error_feedback=error_feedback)
    dl = DiLoCo(model, opt, transport=InProcessGroup(1).transport(0), config=cfg)
    q = dl.codec.qmax
    start, pseudo_grads = dl.global_params[0].clone(), torch.zeros(n, dtype=torch.float64)
    for _ in range(rounds):
        grad = (0.4 + 0.1 * torch.rand(n, generator=g)) / q * torch.randn(n, generator=g).sign()
        grad[:: dl.codec.block] = 1.0
        model.w.grad = grad
        before = dl.global_params[0].clone()
        opt.step()
        pseudo_grads += (before - model.w.detach()).double()  # global - local, as the round computes it
        dl.sync()
    return pseudo_grads, (start - dl.global_params[0]).double(), dl


@pytest.mark.parametrize("wire_dtype", ["int8", "int4"])
def test_error_feedback_makes_the_applied_updates_track_the_sum_of_pseudo_gradients(wire_dtype):
    pseudo_grads, applied, dl = _feedback_rounds(wire_dtype, error_feedback=True)
    half_step = 0.5 * (1 + 1 / dl.codec.qmax) / dl.codec.qmax  # a block's absmax is at most 1 + the residual's
    residual = dl.state_dict()["residual"].double()
    assert residual.shape == (1000,) and 0 < residual.abs().max() <= half_step
    # the updates applied are the pseudo-gradients minus what is still owed (up to fp32 rounding of the sums)
    torch.testing.assert_close(applied, pseudo_grads - residual, atol=1e-5, rtol=0)
    assert (applied - pseudo_grads).abs().max() <= half_step + 1e-5  # never more than half a step behind
    meta, tensors = dl.run_state.snapshot()  # joiners get no residual: it is this worker's own
    assert (meta["round"], meta["num_momentum"], tensors) == (40, 0, [])
    dropped, applied_without, _ = _feedback_rounds(wire_dtype, error_feedback=False)
    assert (applied_without - dropped).abs().max() > 10 * half_step  # without: rounded away every round


def test_the_diagnostic_rms_travels_in_a_block_of_its_own_and_is_not_fed():
    (report,) = _one_round([[0.0, 0.0, 0.0]], "int4")  # pseudo-gradient [1, 2, 2]: norm 3, int4 step 2 / 7
    assert report.pseudo_grad_norm == pytest.approx(3.0, rel=1e-6)
    assert report.mean_pseudo_grad_norm != pytest.approx(3.0, rel=1e-3)  # the values were rounded...
    assert report.agreement == pytest.approx(report.mean_pseudo_grad_norm / 3.0, rel=1e-6)  # ...the RMS was not
    model = Scalar([0.0] * 300)
    opt, t = torch.optim.SGD(model.parameters(), lr=1.0), InProcessGroup(1).transport(0)
    dl = DiLoCo(model, opt, transport=t, config=DiLoCoConfig(codec="int8", codec_block=256))
    # 300 values, zeros up to a block, the blocks of the valid flag, the work, the digest and its square, the RMS
    assert dl.reduce_numel == 512 + 4 * 256 + 1 and dl.state_dict()["residual"].shape == (300,)


def test_a_failed_round_leaves_the_residual_for_its_retry():
    model = Scalar([0.0] * 40)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    t = FailingTransport(
        InProcessGroup(1).transport(0), fail_at={4}
    )  # 1, 2: settings and shape checks, 3: round 1, 4: round 2
    cfg = DiLoCoConfig(inner_steps=1, codec="int4", codec_block=16, round_retries=0)
    dl = DiLoCo(model, opt, transport=t, config=cfg)
    for r in range(2):
        model.w.grad = torch.linspace(-1, 1, 40) * (r + 1)
        opt.step()
        if r == 0:
            dl.sync()
            kept = dl.state_dict()["residual"].clone()
            assert kept.abs().max() > 0
    with pytest.raises(TransportError, match="injected"):
        dl.sync()
    assert torch.equal(dl.state_dict()["residual"], kept)  # the retry feeds the same residual again
    dl.sync()
    assert not torch.equal(dl.state_dict()["residual"], kept)


# -- the contribution guard: a worker whose pseudo-gradient is not finite is left out of the mean -------------


WIRES = [
    ("int8", True),
    ("int8", False),
    ("int4", True),
    ("int2", True),
    ("sign", True),
    ("topk", True),  # its 3 values and the padding kept (k = 4): the guard's flags exact
    ("fp32", True),
    ("fp16", True),
    ("fp16", False),
]


# 1e5: finite, but past fp16's range (on the other wires a valid contribution: the norm guard's case)
@pytest.mark.parametrize(
    ("bad", "wire_dtype", "error_feedback"),
    [(b, *w) for b in (float("nan"), float("inf")) for w in WIRES] + [(1e5, "fp16", True), (1e5, "fp16", False)],
)
def test_a_bad_pseudo_gradient_is_left_out_and_its_worker_takes_the_mean_of_the_others(bad, wire_dtype, error_feedback):
    start, targets = [1.0, 2.0, 2.0], [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, bad, 0.5]]
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, codec=wire_dtype, error_feedback=error_feedback)

    def worker(t: Transport):
        model = Scalar(start)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, cfg)
        move_to(model, opt, targets[t.rank])
        residual = dl.state_dict()["residual"]
        report = dl.step()
        after = dl.state_dict()["residual"]
        kept = residual is None or torch.equal(after, residual)
        return report, dl.global_params[0].clone(), model.w.detach().clone(), kept

    results = run_threads(3, worker)
    codec = codec_for(wire_dtype, cfg.codec_block)
    # each in a partial block of its own 3 values (the sign codec's scale is their mean |x|, not the padding's)
    pseudo_grads = [torch.tensor(start) - torch.tensor(x) for x in targets[:2]]
    want = torch.tensor(start) - reference_mean(pseudo_grads, codec)
    for rank, (report, params, local, kept) in enumerate(results):
        assert (report.num_contributors, report.valid_contributors, report.excluded) == (3, 2, rank == 2), report
        torch.testing.assert_close(params, want, rtol=1e-6, atol=0)  # the mean of the two valid ones
        assert torch.equal(params, results[0][1]) and torch.equal(local, params)  # the same everywhere, finite
        assert kept or rank != 2  # the bad one keeps the residual it had


def test_an_excluded_round_keeps_the_residual_the_worker_owes():
    model = Scalar([0.0] * 40)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = DiLoCoConfig(inner_steps=1, codec="int4", codec_block=16)
    dl = DiLoCo(model, opt, InProcessGroup(1).transport(0), cfg)
    model.w.grad = torch.linspace(-1, 1, 40)
    opt.step()
    dl.step()
    owed = dl.state_dict()["residual"].clone()
    assert owed.abs().max() > 0
    model.w.grad = torch.full((40,), float("nan"))
    opt.step()
    assert dl.step().excluded and torch.equal(dl.state_dict()["residual"], owed)


def test_with_no_valid_contribution_nothing_moves_and_the_round_is_counted():
    def worker(t: Transport):
        model = Scalar([1.0, 2.0])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.5))
        move_to(model, opt, [float("nan"), 0.0])
        report = dl.step()
        return report, model.w.detach().clone(), dl.state_dict()["outer_optimizer"]["state"]

    for report, params, state in run_threads(2, worker):
        assert (report.round, report.valid_contributors, report.excluded) == (1, 0, True)
        assert torch.equal(params, torch.tensor([1.0, 2.0])) and state == {}  # no outer step, no momentum


def test_a_worker_whose_moments_diverged_restarts_its_inner_optimizer():
    model = Scalar([1.0, 2.0])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    dl = DiLoCo(model, opt, InProcessGroup(1).transport(0), DiLoCoConfig(inner_steps=1))
    model.w.grad = torch.tensor([float("nan"), 1.0])
    report = dl.step()  # Adam's moments are NaN now, and so are the weights
    assert report.excluded and len(opt.state) == 0 and torch.equal(model.w.detach(), torch.tensor([1.0, 2.0]))
    model.w.grad = torch.tensor([1.0, 1.0])
    assert not dl.step().excluded and bool(torch.isfinite(model.w).all())  # it trains on


def test_the_norm_guard_clips_an_insiders_huge_contribution_on_every_worker():
    """Round 1 sets the reference; in round 2 worker 2, whose software does not clip itself, sends 6e4 times
    its update: every worker clips the mean to norm_clip times round 1's, the same on every worker. The plain
    mean: the norm guard alone (the robust merge leaves such an insider out first, tests/test_merge.py)."""
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, norm_clip=4.0, merge="mean")

    def worker(t: Transport):
        model = Scalar([0.0] * 8)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, cfg)
        if t.rank == 2:
            dl.guard.admit = lambda pg, norm: (False, False, norm)  # an insider's software: it never clips
        reports = []
        for rnd in range(2):
            model.w.grad = torch.full((8,), 0.1 * (t.rank + 1)) * (6e4 if (rnd, t.rank) == (1, 2) else 1.0)
            opt.step()
            reports.append(dl.step())
        return reports, dl.global_params[0].clone(), dl.state_dict()["guard"]

    results = run_threads(3, worker)
    first_mean = results[0][0][0].mean_pseudo_grad_norm
    for reports, params, guard in results:
        assert not reports[0].clipped and not reports[0].mean_clipped
        assert reports[1].mean_clipped and reports[1].mean_pseudo_grad_norm == pytest.approx(4 * first_mean, rel=1e-5)
        assert torch.equal(params, results[0][1]) and bool(torch.isfinite(params).all())
        assert guard == results[0][2]  # the references are the same on every worker
    assert not any(r[0][1].clipped for r in results)  # the honest ones are within 4x; the insider did not clip
    assert float(results[0][1].norm()) <= 5 * first_mean + 1e-6  # round 1's step plus at most 4 times it


def test_an_honest_outlier_clips_its_own_contribution():
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, norm_clip=4.0)
    model = Scalar([0.0] * 8)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    dl = DiLoCo(model, opt, InProcessGroup(1).transport(0), cfg)
    sent = []
    for scale in (1.0, 100.0):
        model.w.grad = torch.full((8,), 0.1 * scale)
        opt.step()
        report = dl.step()
        sent.append(report.mean_pseudo_grad_norm)
    assert report.clipped and not report.mean_clipped and sent[1] == pytest.approx(4 * sent[0], rel=1e-6)


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16", "int4"])
def test_replicas_that_differ_are_caught_by_the_rounds_digest_on_every_worker(wire_dtype):
    """Two replicas whose global params differ (a bug, a bit flip, a silent pairing) are an error on every worker,
    raised by the round's own reduce before anything changes: with no majority, nobody knows which is right."""
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, codec=wire_dtype)

    def worker(t: Transport):
        model = Scalar([1.0, 2.0, 3.0])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, cfg)
        move_to(model, opt, [0.5, 0.5, 0.5])
        assert dl.step().round == 1  # identical replicas: no complaint
        if t.rank == 1:
            dl.global_params[0][0] += 1.0  # this replica now differs
        before = dl.global_params[0].clone()
        move_to(model, opt, [0.0, 0.0, 0.0])
        with pytest.raises(ValueError, match="the workers' global params differ") as e:
            dl.step()
        assert dl.round == 1 and torch.equal(dl.global_params[0], before)  # nothing changed
        return str(e.value)

    messages = run_threads(2, worker)
    assert len(set(messages)) == 1  # the same error on every worker


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16", "int4"])
def test_a_replica_that_differs_from_the_majority_stops_alone_and_is_named(wire_dtype):
    """One replica of three differs (or an insider forges its digest): the others go on, and it stops itself (it
    once stopped every worker: an insider forging its digest stopped the whole run)."""
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, codec=wire_dtype)

    def worker(t: Transport):
        model = Scalar([1.0, 2.0, 3.0])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        dl = DiLoCo(model, opt, t, cfg)
        move_to(model, opt, [0.5, 0.5, 0.5])
        assert dl.step().round == 1
        if t.rank == 2:
            dl.global_params[0][0] += 1.0  # this replica now differs
        before = dl.global_params[0].clone()
        move_to(model, opt, [0.0, 0.0, 0.0])
        if t.rank == 2:
            with pytest.raises(ValueError, match="this worker's global params differ from the majority's"):
                dl.step()
            assert dl.round == 1 and torch.equal(dl.global_params[0], before)  # nothing changed here
            return None
        report = dl.step()
        return report.round, [(o.who, o.why) for o in report.outliers]

    results = run_threads(3, worker)
    assert results[:2] == [(2, [("rank 2", "control values")])] * 2 and results[2] is None


def test_norm_clip_is_validated():
    for bad in (1.0, 0.5, float("nan"), float("inf"), "4"):
        with pytest.raises(ValueError, match="norm_clip"):
            DiLoCoConfig(norm_clip=bad)


@pytest.mark.parametrize("wire_dtype", ["fp32", "int8", "int4"])
def test_a_huge_finite_pseudo_gradient_is_sent_and_its_norm_reported(wire_dtype):
    # its sum of squares overflows fp32 (1e60): the norm, and the RMS that travels with it, must not be inf
    (report,) = _one_round([[-1e30, -2e30, -2e30]], wire_dtype)  # start [1, 2, 2]: pseudo-gradient ~[1, 2, 2] e30
    assert report.pseudo_grad_norm == pytest.approx(3e30, rel=1e-6) and report.num_contributors == 1
    assert report.mean_pseudo_grad_norm == pytest.approx(3e30, rel=0.05)  # int4 rounds 1 to 8/7 here
    assert report.agreement == pytest.approx(1.0, rel=0.05)


def test_the_norm_guards_reference_tracks_the_honest_rounds_and_a_clipped_round_never_raises_it():
    """The reference is the median of the last WINDOW unclipped rounds' mean norms: honest norms that shrink
    (or grow within the limit) move it; an insider clipped round after round leaves it where it was."""
    guard = ContributionGuard(FP32, norm_clip=4.0, numel=4)

    def round_(norm: float) -> tuple[bool, float]:
        mean = torch.full((4,), norm / 2)  # its norm is ``norm``
        return guard.clip_mean(mean, mean_norm=norm, contributors_norm=norm)

    for norm in [8.0, 4.0, 2.0, 1.0, 1.0, 1.0]:  # honest norms shrink: the reference follows them down
        assert round_(norm) == (False, norm)
    assert guard.ref_mean == 2.0
    for _ in range(3 * WINDOW):  # an attack of 30 rounds: each clipped to 4 x the reference, which stays
        clipped, norm = round_(1e6)
        assert clipped and norm == pytest.approx(8.0)
    assert guard.ref_mean == 2.0
    for norm in [3.0, 5.0] + [7.0] * (WINDOW - 2):  # honest growth within the limit: it follows them up
        assert not round_(norm)[0]
    assert guard.ref_mean == 7.0
    state = guard.state_dict()
    again = ContributionGuard(FP32, norm_clip=4.0, numel=4)
    again.load_state_dict(state)
    assert again.state_dict() == state
    again.load_state_dict({"ref_norm": 1.0, "ref_mean": 3.0})  # saved before the window existed
    assert again.ref_mean == 3.0
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        again.load_state_dict({"ref_norm": 1.0, "ref_mean": 3.0, "means": [float("nan")]})

"""Overlap modes (streaming fragments, eager updates) against hand-written references of their update rules,
blocking DiLoCo where they must equal it bit for bit, and checkpoints taken with reduces in flight."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from threads import run_threads
from torch import nn

from diloco_core import FP32, MEAN, DiLoCo, DiLoCoConfig, Transport, TransportError
from diloco_core.streaming import begins_at, strided_fragments, user_fragments
from diloco_core.transport import Capabilities, ReduceHandle, ReduceResult
from transports import ForwardingTransport, InProcessGroup

pytestmark = pytest.mark.timeout(60)
DIM, BLOCKS = 6, 4


class Tower(nn.Module):
    """An embedding-like vector, a ModuleList of blocks and a head: the shape streaming cuts."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(DIM, generator=g))
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(BLOCKS))
        with torch.no_grad():
            for b in self.blocks:
                b.weight.copy_(torch.randn(DIM, DIM, generator=g) * 0.4)
                b.bias.copy_(torch.randn(DIM, generator=g) * 0.1)
        self.head = nn.Parameter(torch.randn(DIM, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.embed
        for b in self.blocks:
            h = torch.tanh(b(h))
        return h @ self.head


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, DIM, generator=g), torch.randn(8, generator=g)


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    (model(x) - y).pow(2).mean().backward()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(t: Transport, config: DiLoCoConfig, steps: range, state: dict | None = None, save_at: int = -1):
    """Train ``steps`` (inner steps, 0-based) with SGD inner steps; return params, reports, global copy, state."""
    model = Tower()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    dl = DiLoCo(model, opt, t, config)
    if state is not None:
        dl.load_state_dict(state)
    saved, reports = None, []
    for s in steps:
        _inner_step(model, opt, t.rank, s)
        report = dl.step()
        opt.zero_grad()
        if report is not None:
            reports.append((s + 1, report))
        if s + 1 == save_at:
            buf = io.BytesIO()
            torch.save(dl.state_dict(), buf)
            saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    return _params(model), reports, [g.clone() for g in dl.global_params], saved, dl


# -- fidelity ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_streaming_with_one_fragment_no_overlap_and_alpha_0_is_blocking_diloco_bit_for_bit(wire):
    base = {"inner_steps": 3, "outer_lr": 0.7, "outer_momentum": 0.5, "codec": wire, "codec_block": 16}
    blocking = run_threads(2, lambda t: _train(t, DiLoCoConfig(**base), range(12))[:3])
    streamed = run_threads(2, lambda t: _train(t, DiLoCoConfig(**base, overlap="streaming"), range(12))[:3])
    for (pa, ra, ga), (pb, rb, gb) in zip(blocking, streamed):
        assert all(torch.equal(a, b) for a, b in zip(pa + ga, pb + gb))
        assert [s for s, _ in ra] == [s for s, _ in rb] == [3, 6, 9, 12]


def _nesterov(x: torch.Tensor, buf: torch.Tensor | None, g: torch.Tensor, lr: float, mu: float):
    """torch.optim.SGD(nesterov=True)'s step, written out: buf = mu buf + g; x -= lr (g + mu buf)."""
    buf = g.clone() if buf is None else buf.mul(mu).add(g)
    return x - lr * (g + mu * buf), buf


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _set(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        params = list(model.parameters())
        torch._foreach_copy_(params, [f.view_as(p) for f, p in zip(flat.split([p.numel() for p in params]), params)])


@pytest.mark.parametrize("w", [1 / 3, None, 0.6])
def test_eager_updates_follow_a_hand_written_reference_of_the_rule(w):
    """Each worker steps its own params with the previous mean + w (its fresh pseudo-gradient - its previous
    one), at w = 1 / M the paper's (fresh + the others' previous ones) / M, unset max(0.5, 1 / M), while the
    consensus copy steps with the plain one-round-old means; a flush ends on the consensus."""
    m, h, rounds, lr, mu = 3, 2, 5, 0.8, 0.5
    config = DiLoCoConfig(inner_steps=h, outer_lr=lr, outer_momentum=mu, overlap="eager", eager_fresh_weight=w)

    def worker(t: Transport):
        params, _reports, glob, _, dl = _train(t, config, range(h * rounds))
        dl.flush()
        return params, glob, _params(dl.model), [g.clone() for g in dl.global_params]

    got = run_threads(m, worker)
    # the reference: M models trained one after another, no transport
    models = [Tower() for _ in range(m)]
    opts = [torch.optim.SGD(md.parameters(), lr=0.05, momentum=0.5) for md in models]
    x = [_flat(_params(models[0])) for _ in range(m)]
    xbuf: list = [None] * m
    consensus, cbuf, prev = x[0].clone(), None, [torch.zeros_like(x[0]) for _ in range(m)]
    for r in range(rounds):
        for i in range(m):
            for s in range(r * h, (r + 1) * h):
                _inner_step(models[i], opts[i], i, s)
                opts[i].step()
                opts[i].zero_grad()
        fresh = [x[i] - _flat(_params(models[i])) for i in range(m)]
        if r > 0:  # the consensus copy takes last round's mean
            consensus, cbuf = _nesterov(consensus, cbuf, sum(prev) / m, lr, mu)
        for i in range(m):
            if w == 1 / m:
                direction = (fresh[i] + sum(prev[j] for j in range(m) if j != i)) / m
            else:
                direction = sum(prev) / m + (0.5 if w is None else w) * (fresh[i] - prev[i])
            x[i], xbuf[i] = _nesterov(x[i], xbuf[i], direction, lr, mu)
            _set(models[i], x[i])
        prev = fresh
    consensus, cbuf = _nesterov(consensus, cbuf, sum(prev) / m, lr, mu)
    for i, (params, glob_before, flushed, glob_after) in enumerate(got):
        torch.testing.assert_close(_flat(params), x[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_flat(flushed), consensus, rtol=1e-5, atol=1e-6)
        assert torch.equal(_flat(flushed), _flat(glob_after))
    assert not torch.equal(_flat(got[0][0]), _flat(got[1][0]))  # the workers' own params differ, by design
    assert all(torch.equal(_flat(g[2]), _flat(got[0][2])) for g in got)  # the consensus does not


W = 0.6  # eager_fresh_weight of the outer-gradient test, at M = 4


@pytest.mark.parametrize(
    ("valid", "stale_sent", "fresh_valid", "want"),
    [
        (4, True, True, lambda m, s, f: m + W * (f - s)),
        (2, True, True, lambda m, s, f: m - s / 2 + f / 4 + (W - 1 / 4) * (f - s)),
        (1, True, True, lambda m, s, f: m - s + f / 4 + (W - 1 / 4) * (f - s)),
        (3, False, True, lambda m, s, f: m + f / 4),  # this worker's share was excluded from the mean
        (4, True, False, lambda m, s, f: m - s / 4),  # its fresh one is excluded
        (0, False, True, lambda m, s, f: m + f / 4),
    ],
)
def test_eager_outer_gradient_keeps_the_papers_shares_where_a_contribution_was_excluded(
    valid, stale_sent, fresh_valid, want
):
    """With fewer valid contributions than workers (V < M) the stale share is 1 / V of the mean, as in the
    paper's rule; w only moves a change between two valid shares of this worker's."""
    g = torch.Generator().manual_seed(0)
    mean, stale, fresh = (torch.randn(5, generator=g) for _ in range(3))
    model = nn.Linear(4, 1)  # 5 values
    config = DiLoCoConfig(outer_lr=1.0, outer_momentum=0.0, overlap="eager")
    e = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), InProcessGroup(1).transport(0), config).eager
    e.sent.copy_(stale)
    e.sent_valid = stale_sent
    got = e.outer_gradient(mean.clone(), fresh, valid=valid, world=4, w=W, fresh_valid=fresh_valid)
    torch.testing.assert_close(got, want(mean, stale, fresh), rtol=1e-6, atol=1e-6)
    assert torch.equal(e.outer_gradient(None, fresh, valid=0, world=4, w=W, fresh_valid=True), fresh * W)


def test_streaming_follows_a_hand_written_reference_of_fragments_overlap_and_merge():
    """P=2, H=4, tau=1, alpha=0.5: fragment 0 begins at steps 2, 6, ..., fragment 1 at 4, 8, ...; each
    one's outer step lands a step later, merged as alpha * local + (1 - alpha) * global."""
    m, h, p, tau, alpha, lr, mu, steps = 2, 4, 2, 1, 0.5, 0.7, 0.5, 13
    config = DiLoCoConfig(
        inner_steps=h,
        outer_lr=lr,
        outer_momentum=mu,
        overlap="streaming",
        fragments=p,
        overlap_steps=tau,
        merge_alpha=alpha,
    )
    got = run_threads(m, lambda t: _train(t, config, range(steps))[:2])
    models = [Tower() for _ in range(m)]
    opts = [torch.optim.SGD(md.parameters(), lr=0.05, momentum=0.5) for md in models]
    frags = strided_fragments(models[0], list(models[0].parameters()), p)
    glob = next([t.detach().clone() for t in models[0].parameters()] for _ in range(1))
    bufs: dict = {}
    in_flight: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for s in range(1, steps + 1):
        for i in range(m):
            _inner_step(models[i], opts[i], i, s - 1)
            opts[i].step()
            opts[i].zero_grad()
        for f, (due, mean) in list(in_flight.items()):
            if due == s:
                for k, j in enumerate(frags[f]):
                    glob[j], bufs[j] = _nesterov(glob[j], bufs.get(j), mean[k], lr, mu)
                    for md in models:
                        with torch.no_grad():
                            q = list(md.parameters())[j]
                            q.copy_(alpha * q + (1 - alpha) * glob[j])
                del in_flight[f]
        f = begins_at(s, inner_steps=h, fragments=p)
        if f is not None:
            mean = [sum(glob[j] - list(md.parameters())[j].detach() for md in models) / m for j in frags[f]]
            in_flight[f] = (s + tau, mean)
    for i, (params, reports) in enumerate(got):
        assert [(s, r.fragment) for s, r in reports] == [(3, 0), (5, 1), (7, 0), (9, 1), (11, 0), (13, 1)]
        for a, b in zip(params, models[i].parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


# -- checkpoints with reduces in flight --------------------------------------------------------------------

MODES = {
    "eager": {"overlap": "eager"},
    "streaming": {"overlap": "streaming", "fragments": 2, "overlap_steps": 3, "merge_alpha": 0.5},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("wire", ["fp32", "int4"])
def test_a_checkpoint_taken_with_a_reduce_in_flight_resumes_bit_exact(mode, wire):
    config = DiLoCoConfig(inner_steps=4, outer_lr=0.7, codec=wire, codec_block=16, **MODES[mode])
    whole = run_threads(2, lambda t: _train(t, config, range(14))[:3])
    saving = run_threads(2, lambda t: _train(t, config, range(14), save_at=6))
    states = [r[3] for r in saving]
    assert all("in_flight" in s for s in states)  # step 6: eager's round-1 reduce, streaming's fragment 0
    it = iter(range(2))
    lock = threading.Lock()

    def resume(t: Transport):
        with lock:
            next(it)
        return _train(t, config, range(6, 14), state=states[t.rank])[:3]

    resumed = run_threads(2, resume)
    for a, b, c in zip(whole, [r[:3] for r in saving], resumed):
        for x, y, z in zip(a[0] + a[2], b[0] + b[2], c[0] + c[2]):
            assert torch.equal(x, y) and torch.equal(x, z)


# -- fragments, settings and failures ------------------------------------------------------------------------


def test_strided_fragments_spread_the_blocks_and_balance_the_rest():
    model = Tower()
    names = [n for n, _ in model.named_parameters()]
    frags = strided_fragments(model, list(model.parameters()), 2)
    got = [[names[i] for i in f] for f in frags]
    assert got == [
        ["embed", "blocks.0.weight", "blocks.0.bias", "blocks.2.weight", "blocks.2.bias"],
        ["head", "blocks.1.weight", "blocks.1.bias", "blocks.3.weight", "blocks.3.bias"],  # the model's order
    ]
    with pytest.raises(ValueError, match="fragments=5 needs a model with at least 5 repeated blocks"):
        strided_fragments(model, list(model.parameters()), 5)
    with pytest.raises(ValueError, match="'head' is in fragments 0 and 1"):
        user_fragments(names, [names, ["head"]], 2)
    with pytest.raises(ValueError, match="1 trainable parameter\\(s\\) are in no fragment, first 'head'"):
        user_fragments(names, [[n for n in names if n != "head"]], 1)


def test_user_fragments_are_used_as_given():
    model = Tower()
    names = [n for n, _ in model.named_parameters()]
    config = DiLoCoConfig(inner_steps=2, overlap="streaming", fragments=2)
    dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), InProcessGroup(1).transport(0), config,
                fragments=[["head"], [n for n in names if n != "head"]])  # fmt: skip
    assert [f.flat.numel() for f in dl.fragments] == [DIM, sum(p.numel() for p in model.parameters()) - DIM]
    assert [f.key for f in dl.fragments] == ["diloco/fragment/0", "diloco/fragment/1"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"overlap": "async"}, "overlap='async' is invalid: expected one of ['none', 'streaming', 'eager']"),
        (
            {"overlap": "streaming", "fragments": 5, "inner_steps": 4},
            "fragments=5 is invalid: expected an integer in [1",
        ),
        (
            {"overlap": "streaming", "overlap_steps": 4, "inner_steps": 4},
            "overlap_steps=4 is invalid: expected an integer",
        ),
        ({"overlap": "streaming", "merge_alpha": -0.1}, "merge_alpha=-0.1 is invalid: expected a number in [0, 1]"),
        ({"overlap": "eager", "fragments": 2}, "are streaming's settings: set overlap='streaming'"),
        ({"overlap": "eager", "eager_fresh_weight": 0}, "eager_fresh_weight=0 is invalid: expected a number in (0, 1]"),
        ({"overlap": "eager", "eager_fresh_weight": 1.5}, "eager_fresh_weight=1.5 is invalid: expected a number in"),
        ({"eager_fresh_weight": 0.5}, "eager_fresh_weight=0.5 is eager's setting: set overlap='eager'"),
    ],
)
def test_overlap_settings_are_validated_with_the_field_and_its_range(settings, message):
    with pytest.raises(ValueError) as e:
        DiLoCoConfig(**settings)
    assert message in str(e.value)


class _Done(ReduceHandle):
    def __init__(self, result: ReduceResult) -> None:
        self._result = result

    def wait(self, timeout: float) -> ReduceResult:
        return self._result

    def completed(self) -> ReduceResult | None:
        return self._result


class _Swarm(ForwardingTransport):
    """Peers that come and go, whose reduces complete in the background (as hivemind's): here at once."""

    capabilities = Capabilities(fixed_ranks=False)

    def all_reduce(self, tensors, *, codec=FP32, key="default", merge=MEAN):
        return _Done(self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge).wait(10))


@pytest.mark.parametrize(("mode", "taken_at"), [("eager", 5), ("streaming", 2), ("streaming", 6)])
def test_a_peer_that_loads_the_run_state_mid_overlap_applies_the_same_means_at_the_same_steps(mode, taken_at):
    """What a hivemind joiner or re-synced peer gets: the completed means in flight and the step, with the round
    and momentum; from the same local params and data it then holds the same global copy as its donor."""
    settings = {"fragments": 2, "overlap_steps": 1} if mode == "streaming" else {}
    config = DiLoCoConfig(inner_steps=4, outer_lr=0.7, outer_momentum=0.5, overlap=mode, **settings)

    def build() -> tuple[DiLoCo, nn.Module]:
        model = Tower()
        return DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), _Swarm(InProcessGroup(1).transport(0)),
                      config), model  # fmt: skip

    (donor, dmodel), (peer, pmodel) = build(), build()
    for s in range(taken_at):
        _inner_step(dmodel, None, 0, s)
        donor.step()
        donor.inner_optimizer.zero_grad()
    meta, tensors = donor.run_state.snapshot()
    assert meta["inner_step"] == taken_at and len(meta["in_flight"]) == 1, meta
    with pytest.raises(ValueError, match="overlap settings"):
        build()[0].run_state.loader({k: v for k, v in meta.items() if k != "inner_step"}, tensors)
    torch._foreach_copy_(peer.global_params, donor.global_params)  # what the broadcast does on a joiner
    peer.run_state.loader(meta, tensors)()
    assert (peer.round, peer.inner_step) == (donor.round, donor.inner_step)
    with torch.no_grad():  # the same local training from here
        torch._foreach_copy_(list(pmodel.parameters()), list(dmodel.parameters()))
    ends = 8 if mode == "eager" else 16  # eager: its own params differ by design; the consensus copy matches
    for s in range(taken_at, ends):
        for dl, model in ((donor, dmodel), (peer, pmodel)):
            _inner_step(model, None, 0, s)
            dl.step()
            dl.inner_optimizer.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(donor.global_params, peer.global_params)), s + 1
    assert donor.round == peer.round and peer.in_flight != ()


def test_the_run_state_is_not_served_while_a_reduce_in_flight_has_not_completed_and_inside_a_boundary_is_a_step_back():
    model = Tower()
    config = DiLoCoConfig(inner_steps=4, outer_lr=0.7, overlap="eager")
    dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), InProcessGroup(1).transport(0), config)
    for s in range(5):  # the in-process reduce puts its mean in place only when waited for: never "completed"
        _inner_step(model, None, 0, s)
        dl.step()
        dl.inner_optimizer.zero_grad()
    assert dl.in_flight and dl.run_state.snapshot() is None
    dl.flush()  # nothing in flight any more
    with dl.run_state.boundary(9):  # as a reduce starts at step 9: the state before that step's outer work
        meta, _ = dl.run_state.snapshot()
    assert meta["inner_step"] == 8 and meta["in_flight"] == []
    assert dl.run_state.snapshot()[0]["inner_step"] == 5


@pytest.mark.parametrize("mode", ["eager", "streaming"])
def test_a_blocking_round_is_refused_while_an_overlap_mode_has_a_reduce_in_flight(mode):
    """``sync()``, ``begin_round()`` and ``finish_round()`` would run a blocking round beside the reduce in flight
    (eager: writing the buffer that reduce may still read); they refuse, naming ``overlap``, and change nothing."""
    settings = {"fragments": 2, "overlap_steps": 1} if mode == "streaming" else {}
    config = DiLoCoConfig(inner_steps=4, outer_lr=0.7, overlap=mode, **settings)
    model = Tower()
    dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), InProcessGroup(1).transport(0), config)
    for s in range(5 if mode == "eager" else 2):  # a reduce in flight
        _inner_step(model, None, 0, s)
        dl.step()
        dl.inner_optimizer.zero_grad()
    before = (dl.round, _flat(dl.global_params).clone(), _params(model))
    for call in (dl.sync, dl.begin_round, lambda: dl.finish_round(dl.in_flight[0])):
        with pytest.raises(RuntimeError, match=f"overlap='{mode}'.*step\\(\\).*flush\\(\\)"):
            call()
    assert dl.round == before[0] and len(dl.in_flight) == 1 and dl.in_flight[0].settled is None
    assert torch.equal(_flat(dl.global_params), before[1])
    assert all(torch.equal(a, b) for a, b in zip(_params(model), before[2]))
    dl.flush()  # what to call instead at the end of training
    assert dl.in_flight == ()


def test_workers_with_different_overlap_settings_are_refused():
    def worker(t: Transport):
        model = Tower()
        mode = {"overlap": "eager"} if t.rank else {}
        try:
            DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), t, DiLoCoConfig(reduce_timeout=10, **mode))
        except ValueError as e:
            return str(e)
        return None

    for message in run_threads(2, worker):
        assert message is not None and "overlap" in message


def test_a_lost_peer_during_an_eager_reduce_fails_the_round_and_changes_nothing():
    """Worker 1 goes silent with its round-2 reduce in flight; worker 0's next boundary retries (sending the same
    share again), then raises TransportError with its consensus copy, own params and model as they were."""
    config = DiLoCoConfig(inner_steps=2, outer_lr=0.7, overlap="eager", reduce_timeout=1.0, round_retries=1)

    def worker(t: Transport):
        model = Tower()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dl = DiLoCo(model, opt, t, config)
        for s in range(4):
            _inner_step(model, opt, t.rank, s)
            dl.step()
            opt.zero_grad()
        if t.rank == 1:  # gone silent (a closed in-process member would leave the group: the round goes on)
            return None
        for s in range(4, 7):  # boundary 3 settles round 2's reduce (both sent it) and sends round 3's alone
            _inner_step(model, opt, t.rank, s)
            dl.step()
            opt.zero_grad()
        before = [_flat(dl.global_params).clone(), dl.eager.flat.clone()]
        _inner_step(model, opt, t.rank, 7)
        with pytest.raises(TransportError):
            dl.step()
        assert torch.equal(_flat(dl.global_params), before[0]) and torch.equal(dl.eager.flat, before[1])
        assert dl.round == 3 and len(dl.in_flight) == 1
        return True

    assert run_threads(2, worker)[0] is True


# -- the trainer ---------------------------------------------------------------------------------------------

TRAINER_MODES = {
    "none": [],
    "eager": ["--set", "diloco.overlap=eager"],
    "streaming": [
        "--set",
        "diloco.overlap=streaming",
        "--set",
        "diloco.fragments=2",
        "--set",
        "diloco.overlap_steps=1",
    ],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", sorted(TRAINER_MODES))
def test_the_trainer_resumes_an_overlapped_run_from_a_checkpoint_with_a_reduce_in_flight_exactly(tmp_path, mode):
    """Checkpoints fall on round boundaries (step 4, 8), where eager's reduce and streaming's second fragment
    are in flight; the resumed run's losses are the uninterrupted run's, and both end on the same eval."""
    from runs import FAST, losses

    from diloco_train.cli import main

    fast = [
        a.replace("diloco.inner_steps=3", "diloco.inner_steps=4").replace("num_layers=1", "num_layers=2") for a in FAST
    ]
    common = ["--set", f"train.runs_dir={tmp_path!s}", *fast, *TRAINER_MODES[mode]]
    assert main(["train", "--name", "whole", *common]) == 0
    assert main(["train", "--name", "split", *common, "--set", "train.stop_after=8"]) == 0
    assert main(["train", "--name", "split", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]) == 0
    whole, split = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert len(whole) == 12 and split == whole


def test_a_streaming_state_taken_before_every_fragment_synced_loads_on_a_joiner():
    """A streaming peer's state holds momentum only for the fragments that have had a round. Before, a joiner
    refused it ("holds 1 momentum buffers for 2 outer parameter(s)"): one joining a streaming swarm in its first
    round could not take the state."""
    config = DiLoCoConfig(inner_steps=4, overlap="streaming", fragments=2, outer_momentum=0.9)
    source = _train(InProcessGroup(1).transport(0), config, range(2))[-1]  # fragment 0's round, not 1's
    meta, tensors = source.run_state.snapshot()
    assert (meta["round"], meta["num_momentum"]) == (1, 1)
    joiner = _train(InProcessGroup(1).transport(0), config, range(0))[-1]
    torch._foreach_copy_(joiner.global_params, source.global_params)  # what the broadcast does on a joiner
    joiner.run_state.loader(meta, tensors)()
    got_meta, got = joiner.run_state.snapshot()
    del got_meta["ended_at"], meta["ended_at"]  # the wall clock of the source's last round, not loaded
    assert got_meta == meta and all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))

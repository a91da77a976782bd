"""Radial-directional averaging (diloco_core/directions.py, ``DiLoCoConfig.rda``): each tensor's step is the
workers' mean norm along their mean unit direction, against a plain fp64 reference of the formula."""

from __future__ import annotations

import math

import pytest
import torch
from threads import run_threads

from diloco_core import DiLoCo, DiLoCoConfig, Merge, MergeRule, codec_for
from diloco_core.fragment import Fragment
from transports import InProcessGroup

SHAPES = [(8, 40), (40,), (3, 5, 7), (1,)]  # 466 values: a partial last block on every codec block tried


def _deltas(k: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """``k`` workers' pseudo-gradients, tensor by tensor: a shared direction plus each one's noise, norms apart."""
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(s, generator=g) for s in SHAPES]
    return [[(x + torch.randn(s, generator=g)) * (1 + i) / 3 for x, s in zip(shared, SHAPES)] for i in range(k)]


def _reference(deltas, *, works=None, norms_of=None, directions_of=None, codec=None) -> list[torch.Tensor]:
    """RDA in fp64, per tensor: Σ w ||Δ|| / Σ w along unit(Σ w unit(Δ)) over the workers in ``norms_of`` and
    ``directions_of`` (indices; all unless given); with a lossy ``codec``, of what its wire delivers: each worker's
    directions as the codec decodes them, its norms as it decodes a block of one value (block codecs: exact)."""
    k = len(deltas)
    works = works or [1.0] * k
    units = [_wire(codec, [d / d.norm() for d in ds]) for ds in deltas]
    norms = [
        [_wire(codec, [torch.full((getattr(codec, "block", 1),), float(d.norm()))])[0][0] for d in ds] for ds in deltas
    ]
    out = []
    for t in range(len(deltas[0])):
        ns, ds = norms_of or range(k), directions_of or range(k)
        norm = sum(works[i] * norms[i][t].double() for i in ns) / sum(works[i] for i in ns)
        u = sum(works[i] * units[i][t].double() for i in ds)
        out.append((norm * u / u.norm()).float())
    return out


def _wire(codec, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as a peer decodes them, sent back to back (fp32: as they are)."""
    if codec is None:
        return tensors
    n = sum(u.numel() for u in tensors)
    flat = torch.zeros(n + codec.block)
    flat[:n] = torch.cat([u.reshape(-1) for u in tensors])
    codec.pad(flat, n)
    flat = codec.decode(codec.encode(flat), torch.empty_like(flat))[:n]
    return [p.view(u.shape) for p, u in zip(flat.split([u.numel() for u in tensors]), tensors)]


def _round(deltas, *, codec="fp32", block=32, rule="robust", works=None, tamper=None, error_feedback=False):
    """One round of ``Fragment``s (global copy zero, local = -Δ) on in-process threads, with RDA: each worker's
    (merged tensors, valid, left out). ``tamper(rank, reduce_flat, directions)``: what an insider changes before
    sending."""
    c = codec_for(codec, block)

    def worker(transport):
        rank = transport.rank
        local = [-d.clone() for d in deltas[rank]]
        flat = torch.zeros(sum(t.numel() for t in local))
        views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in local]), local)]
        f = Fragment(
            "rda",
            local=local,
            flat=flat,
            views=views,
            codec=c,
            norm_clip=None,
            error_feedback=error_feedback,
            compare=True,
            merge=Merge(rule=MergeRule(rule)),
            rda=True,
        )
        _, excluded, _, sent_norm = f.pseudo_gradient()
        if tamper is not None:
            tamper(rank, f.reduce.flat, f.directions)
        work = works[rank] if works else 1.0
        handle, excluded = f.send(transport, excluded=excluded, norm=sent_norm, work=work)
        result = handle.wait(30)
        settled = f.settle(result, excluded=excluded)
        return [v.clone() for v in f.reduce.views], settled.valid, [o.who for o in result.left_out]

    return run_threads(len(deltas), worker)


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(("rule", "works"), [("mean", [1.0, 2.0, 0.5]), ("robust", None)])
def test_rda_is_the_mean_norm_along_the_mean_direction_with_work_weights_and_the_same_on_every_worker(rule, works):
    deltas = _deltas(3)
    results = _round(deltas, rule=rule, works=works)
    _close(results[0][0], _reference(deltas, works=works))
    assert all(r[1:] == (3, []) for r in results)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r[0], results[0][0]))
    merged = _round(deltas, rule=rule)[0][0]  # the step keeps the workers' length: the plain mean's is shorter
    for t, m in enumerate(merged):
        mean_norm = sum(float(d[t].norm()) for d in deltas) / 3
        assert math.isclose(float(m.norm()), mean_norm, rel_tol=1e-5)
        assert float(sum(d[t] for d in deltas).norm()) / 3 < 0.95 * mean_norm


@pytest.mark.parametrize(("codec", "block"), [("int4", 32), ("sign", 32), ("int8", 256), ("bf16", 1)])
@pytest.mark.parametrize("error_feedback", [False, True])  # the first round's residual is zero: the same
def test_a_lossy_wire_carries_the_norms_exactly_and_the_directions_as_it_decodes_them(codec, block, error_feedback):
    deltas = _deltas(3, seed=1)
    results = _round(deltas, codec=codec, block=block, error_feedback=error_feedback)
    _close(results[0][0], _reference(deltas, codec=codec_for(codec, block)))
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r[0], results[0][0]))


def test_an_excluded_worker_is_left_out_of_both_means():
    deltas = _deltas(4, seed=2)
    deltas[1][2][0, 0, 0] = float("nan")
    results = _round(deltas)
    assert {r[1] for r in results} == {3}
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r[0], results[0][0]))
    _close(results[2][0], _reference(deltas, norms_of=[0, 2, 3], directions_of=[0, 2, 3]))


def test_the_robust_merge_leaves_an_insiders_norms_out_and_keeps_its_honest_directions():
    """An insider that sends 1000 times its update sends its own (honest) directions and 1000 times its norms:
    the norms are judged apart from the directions, so only its norms are left out."""
    deltas = _deltas(4, seed=3)
    deltas[3] = [d * 1000 for d in deltas[3]]
    for merged, valid, left_out in _round(deltas):
        assert valid == 4 and left_out == ["rank 3"]
        _close(merged, _reference([*deltas[:3], [d / 1000 for d in deltas[3]]], norms_of=[0, 1, 2]))


def _scaled_directions(scale: float):
    def tamper(rank, flat, directions):
        if rank == 3:
            flat[: directions.numel].mul_(scale)

    return tamper


def test_the_robust_merge_leaves_an_insiders_flipped_directions_out_whatever_the_norms():
    """Judged with the norms (a run of 256 copies each, far longer than a unit direction), a direction sent times
    -3 hides in the norms' spread (nothing was left out so); judged apart, it is left out, its norms kept."""
    deltas = _deltas(4, seed=4)
    for merged, valid, left_out in _round(deltas, block=256, codec="int8", tamper=_scaled_directions(-3.0)):
        assert valid == 4 and left_out == ["rank 3"]
        _close(merged, _reference(deltas, directions_of=[0, 1, 2], codec=codec_for("int8", 256)))


def test_an_insiders_directions_ten_times_longer_are_bounded_apart_from_the_norms():
    """A direction sent times 10 (an order of magnitude, what a learning rate's phase does to an honest update)
    is not left out (issue 43: honest diversity kept) but clipped to the radius, judged apart from the norms:
    the result is nearer the honest workers' than the plain mean of all four is."""
    deltas = _deltas(4, seed=4)
    tamper = _scaled_directions(10.0)
    honest = _reference(deltas, directions_of=[0, 1, 2], codec=codec_for("int8", 256))
    robust = _round(deltas, block=256, codec="int8", tamper=tamper)
    plain = _round(deltas, block=256, codec="int8", tamper=tamper, rule="mean")
    for (merged, valid, left_out), (mean, _, _) in zip(robust, plain):
        assert valid == 4 and left_out == []
        off = sum(float((m - h).norm()) for m, h in zip(merged, honest))
        off_plain = sum(float((m - h).norm()) for m, h in zip(mean, honest))
        assert off < 0.75 * off_plain  # measured: 19.4 against 30.6


@pytest.mark.parametrize("codec", ["fp32", "int4", "sign"])
def test_a_part_merged_on_its_own_judges_the_norms_apart_as_the_whole_does(codec):
    """As a transport that merges parts (hivemind, torch's scatter-gather): a part that begins inside the norms judges
    its own norm values, reading them from a block's start (``Codec.pieces``' ``start``)."""
    c, g = codec_for(codec, 32), torch.Generator().manual_seed(5)
    shared = torch.randn(256, generator=g)
    rows = [torch.cat([shared + torch.randn(256, generator=g), torch.full((128,), 2.0 + i / 10)]) for i in range(4)]
    rows[3][256:] *= 100
    payloads = [c.encode(r.clone()) for r in rows]
    decoded = torch.stack([c.decode(p, torch.empty(384)) for p in payloads])
    pieces = torch.cat([p.clone() for p in c.pieces(payloads, 384, span=range(64, 200), size=32)], dim=1)
    assert torch.equal(pieces, decoded[:, 64:200])
    merge, whole = Merge(rule=MergeRule.ROBUST, judged=384, apart=256), torch.empty(384)
    assert [o.who for o in merge.of(payloads, codec=c, out=whole)] == ["3"]
    torch.testing.assert_close(whole[:256], decoded[:, :256].mean(0))  # every direction kept
    torch.testing.assert_close(whole[256:], decoded[:3, 256:].mean(0))
    part = torch.empty(96)
    left_out = merge.of([c.encode(r[288:].clone()) for r in rows], codec=c, out=part, start=288)
    assert [o.who for o in left_out] == ["3"] and torch.equal(part, whole[288:])


def _train(config: DiLoCoConfig, *, world: int = 3, steps: int = 4):
    """``world`` workers whose local params are the global ones plus noise, shared and their own, at every step
    (inner lr 0); per step: the global params before, each worker's pseudo-gradient, the global params after."""
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6)).state_dict()

    def worker(transport):
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))
        model.load_state_dict(start)
        dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.0), transport, config)
        own, steps_seen = torch.Generator().manual_seed(transport.rank), []
        for step in range(steps):
            before, shared = [p.clone() for p in dl.global_params], torch.Generator().manual_seed(100 + step)
            with torch.no_grad():
                for p, b in zip(model.parameters(), before):
                    noise = torch.randn(p.shape, generator=shared) + torch.randn(p.shape, generator=own)
                    p.copy_(b + noise * (1 + transport.rank / 10))
            delta = [b - p.detach() for b, p in zip(before, model.parameters())]
            dl.step()
            steps_seen.append((before, delta, [p.clone() for p in dl.global_params]))
        return steps_seen

    return run_threads(world, worker)


@pytest.mark.parametrize("overlap", [{}, {"overlap": "streaming", "fragments": 2}])
def test_diloco_steps_by_rda_blocking_and_streamed_bit_identically_on_every_worker(overlap):
    cfg = DiLoCoConfig(inner_steps=2, outer_lr=1.0, outer_momentum=0.0, rda=True, **overlap)
    runs, moved = _train(cfg), 0
    for s, (before, _, after) in enumerate(runs[0]):
        assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run[s][2], after))
        for t, (b, a) in enumerate(zip(before, after)):
            if not torch.equal(a, b):  # a tensor synchronized at this step: global - RDA of the pseudo-gradients
                moved += 1
                want = b - _reference([[run[s][1][t]] for run in runs])[0]
                torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
    assert moved == 2 * 4  # every tensor twice in 4 steps (H = 2)


def test_rda_is_refused_with_eager_updates_the_topk_codec_and_fsdp_shards():
    with pytest.raises(ValueError, match="rda=True .* overlap='eager'"):
        DiLoCoConfig(rda=True, overlap="eager")
    with pytest.raises(ValueError, match="rda=True .* codec='topk'"):  # its norms would decode to 0: no step at all
        DiLoCoConfig(rda=True, codec="topk")
    model = torch.nn.Linear(2, 2)
    model.weight.to_local = lambda: model.weight.data.clone()  # a DTensor's local shard, duck-typed as flat.py does
    with pytest.raises(ValueError, match="rda=True .* FSDP2"):
        DiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.1), InProcessGroup(1).transport(0), DiLoCoConfig(rda=True)
        )

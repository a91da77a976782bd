"""Control values judged per contributor (diloco_core/control.py): what an honest guard never writes is corrected
and its sender named; what it writes is left as it is."""

from __future__ import annotations

import pytest
import torch
from threads import run_threads

from diloco_core import MEAN, DiLoCo, DiLoCoConfig, Transport, codec_for
from diloco_core.codecs.base import FP32
from diloco_core.control import ControlLayout, judge_controls
from diloco_core.guard import MAX_WORK, ContributionGuard
from transports import ForwardingTransport


def _tails(k: int, *, numel: int = 40, block: int = 8) -> tuple[torch.Tensor, ControlLayout, int]:
    """k honest contributions' reduce buffers (pseudo-gradient and the guard's tail), as rows, and the layout."""
    codec = FP32.with_block(block)
    guard = ContributionGuard(codec, norm_clip=None, numel=numel)
    rows = []
    for i in range(k):
        flat = torch.zeros(numel + guard.tail_size)
        flat[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(i))
        guard.mark(flat, excluded=False, norm=1.0, global_flat=torch.ones(64))
        rows.append(flat)
    return torch.stack(rows), guard.controls, numel


def test_honest_tails_are_left_as_they_are():
    values, layout, _ = _tails(3)
    before = values.clone()
    assert judge_controls(values, layout, lo=0) == set()
    assert torch.equal(values, before)


def test_a_forged_valid_flag_counts_as_one_and_is_named():
    values, layout, _ = _tails(3)
    values[2, layout.valid_at : layout.valid_at + layout.block] = -2.0  # froze every round before
    assert judge_controls(values, layout, lo=0) == {2}
    assert bool((values[:, layout.valid_at] == 1.0).all())


def test_a_work_claim_is_clamped_to_the_guard_range():
    values, layout, _ = _tails(3)
    b = layout.block
    values[1, layout.work_at : layout.work_at + b] = -2.9999  # scaled the mean by 30,000 before
    values[2, layout.work_at : layout.work_at + b] = 1e9
    assert judge_controls(values, layout, lo=0) == {1, 2}
    assert values[1, layout.work_at].item() == -1.0  # a work of 0: it weighs nothing
    assert values[2, layout.work_at].item() == MAX_WORK - 1


def test_an_honest_claim_of_a_few_steps_of_a_long_round_is_left_as_it_is():
    """Rounds by time: one step of ``inner_steps = 500`` claims a work of 0.002 (before: raised to
    1 / MAX_WORK and its sender named)."""
    values, layout, _ = _tails(3)
    b = layout.block
    values[1, layout.work_at : layout.work_at + b] = 1 / 500 - 1
    values[2, layout.work_at : layout.work_at + b] = 0.2 - 1
    before = values.clone()
    assert judge_controls(values, layout, lo=0) == set()
    assert torch.equal(values, before)


def test_a_minority_digest_takes_the_majority_s_and_is_named():
    values, layout, _ = _tails(3)
    b, at = layout.block, layout.digest_at
    honest = values[0, at].item()
    values[1, at : at + b] = (honest + 1) % 16
    values[1, at + b : at + 2 * b] = ((honest + 1) % 16) ** 2
    assert judge_controls(values, layout, lo=0) == {1}
    assert bool((values[:, at] == honest).all()) and bool((values[:, at + b] == honest**2).all())


def test_two_digests_apart_have_no_majority_and_stay_for_the_guard_to_refuse():
    values, layout, _ = _tails(2)
    at = layout.digest_at
    values[1, at : at + layout.block] = (values[0, at].item() + 1) % 16
    values[1, at + layout.block : at + 2 * layout.block] = values[1, at].item() ** 2
    before = values.clone()
    assert judge_controls(values, layout, lo=0) == set()
    assert torch.equal(values, before)


def test_a_slice_judges_only_the_blocks_it_holds():
    values, layout, _ = _tails(3)
    values[2, layout.valid_at : layout.valid_at + layout.block] = 7.0
    values[2, layout.work_at : layout.work_at + layout.block] = 50.0
    lo = layout.work_at  # a part that begins at the work claim: the flag is another part's
    part = values[:, lo:].clone()
    assert judge_controls(part, layout, lo=lo) == {2}
    assert part[2, 0].item() == MAX_WORK - 1 and values[2, layout.valid_at].item() == 7.0


@pytest.mark.parametrize("forged", ["digest", "square"])
def test_a_forged_digest_is_named_where_a_cut_falls_between_the_digest_and_its_square(forged):
    """hivemind's parts cut the reduce buffer at multiples of a part's size: with 4 peers and the
    default model, every round's cut fell between the digest's block and its square's; each part
    then judged neither, and a forged digest was never named (bench/insider.py on 4 hivemind
    peers)."""
    values, layout, _ = _tails(4)
    b, at = layout.block, layout.digest_at
    honest = values[0, at].item()
    bad = at if forged == "digest" else at + b
    values[3, bad : bad + b] = 3.5 if forged == "digest" else 7.0  # no integer / no digest's square
    cut = at + b
    first, second = values[:, :cut].clone(), values[:, cut:].clone()
    named = judge_controls(first, layout, lo=0) | judge_controls(second, layout, lo=cut)
    assert named == {3}
    assert bool((first[:, at] == honest).all()) and bool((second[:, 0] == honest**2).all())


def test_a_non_finite_or_negative_rms_is_zero():
    values, layout, _ = _tails(3)
    values[0, -1] = float("nan")
    values[1, -1] = -5.0
    assert judge_controls(values, layout, lo=0) == {0, 1}
    assert values[0, -1].item() == 0.0 and values[1, -1].item() == 0.0


class _Forger(ForwardingTransport):
    """An insider: its guard's control value at ``where`` (``ControlLayout``'s attribute) reads ``value``."""

    def __init__(self, inner, where: str, value: float) -> None:
        super().__init__(inner)
        self.where, self.value = where, value

    def all_reduce(self, tensors, *, codec=FP32, key="default", merge=MEAN):
        if merge.controls is not None:
            at = getattr(merge.controls, self.where)
            tensors[0][at : at + merge.controls.block] = self.value
        return self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge)


def _run(forge: tuple[str, float] | None, *, codec: str = "int4", rounds: int = 4) -> list:
    """Three workers fitting one target in ``rounds`` rounds; worker 2 forges ``forge`` (attribute, value)."""

    def worker(t: Transport):
        if forge is not None and t.rank == 2:
            t = _Forger(t, *forge)
        model = torch.nn.Linear(8, 8)
        init = torch.Generator().manual_seed(0)  # the same start on every worker (threads share torch's global RNG)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=init))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dl = DiLoCo(model, opt, t, DiLoCoConfig(inner_steps=2, codec=codec))
        data = torch.Generator().manual_seed(t.rank)
        reports = []
        while len(reports) < rounds:
            x = torch.randn(16, 8, generator=data)
            model(x).sub(x.flip(1)).square().mean().backward()
            report = dl.step()
            opt.zero_grad()
            if report:
                reports.append(report)
        return reports, [p.detach().clone() for p in dl.global_params]

    return run_threads(3, worker)


@pytest.mark.parametrize(
    ("forge", "was"),
    [
        (("work_at", -2.9999), "the round's mean times 30,000"),
        (("valid_at", -2.0), "no outer step in any round"),
        (("digest_at", 3.5), "every worker stopped"),
    ],
)
def test_an_insider_forging_a_control_value_is_corrected_and_named(forge, was):
    honest = _run(None)
    forged = _run(forge)
    for reports, params in forged[:2]:
        assert all(r.valid_contributors == 3 for r in reports), was
        assert all([(o.who, o.why) for o in r.outliers] == [("rank 2", "control values")] for r in reports)
        assert all(bool(torch.isfinite(p).all()) for p in params)
        moved = sum(float((p - q).norm()) for p, q in zip(params, honest[0][1]))
        assert moved < sum(float(q.norm()) for q in honest[0][1]), was  # never 30,000 times a round's step


def test_values_a_block_codec_rounds_are_judged_by_what_they_stand_for():
    """int4 at block 256 carries a block of 121 (digest 11, squared) as 121.0000076: an honest digest so decoded is
    the honest one, never named, and the insider's 3.5 beside two such honest ones is still corrected (the
    trainer's run stopped at round 26 when it was not: no digest matched exactly, so there was no majority)."""
    codec = codec_for("int4", block=256)
    guard = ContributionGuard(codec, norm_clip=None, numel=512)
    layout, b = guard.controls, codec.block
    rows = []
    for i in range(3):
        flat = torch.zeros(512 + guard.tail_size)
        flat[:512] = torch.randn(512, generator=torch.Generator().manual_seed(i))
        guard.mark(flat, excluded=False, norm=1.0, global_flat=torch.ones(8))
        flat[layout.digest_at : layout.digest_at + b] = 11.0
        flat[layout.digest_at + b : layout.digest_at + 2 * b] = 121.0
        rows.append(codec.decode(codec.encode(flat), torch.empty_like(flat)))
    values = torch.stack(rows)
    assert values[0, layout.digest_at + b].item() != 121.0  # the case: not exactly the square
    assert judge_controls(values.clone(), layout, lo=0) == set()
    values[2, layout.digest_at : layout.digest_at + b] = 3.5
    assert judge_controls(values, layout, lo=0) == {2}
    assert values[2, layout.digest_at].item() == 11.0

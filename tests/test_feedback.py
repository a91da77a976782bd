"""Error feedback's accounting: what was sent sums to what was fed minus the residual, which stays bounded."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_core import BF16, FP16, FP32, codec_for
from diloco_core.feedback import ErrorFeedback

BLOCK_CODECS = [codec_for(name, block=b) for name in ("int8", "int4", "int2") for b in (16, 256)]


def _per_value_absmax(codec, x: torch.Tensor) -> torch.Tensor:
    """Each value's block absmax (the partial last block zero-padded, as encoded)."""
    b = codec.block
    padded = torch.nn.functional.pad(x, (0, -x.numel() % b)).view(-1, b)
    return padded.abs().amax(1).repeat_interleave(b)[: x.numel()]


def _bound(codec, flat: torch.Tensor) -> torch.Tensor:
    """Each value's largest loss in the round trip of ``flat``: int8 / int4 half a step (absmax / q); int2 a third
    of its block's scale up to the scale, absmax - scale beyond (clipped to it)."""
    absmax = _per_value_absmax(codec, flat)
    if codec.name != "int2":
        return absmax / codec.qmax / 2
    blocks = -(-flat.numel() // codec.block)
    scale = codec.encode(flat)[: 4 * blocks].view(torch.float32).repeat_interleave(codec.block)[: flat.numel()]
    return torch.maximum(scale / 3, absmax - scale)


def _lasting(codec) -> float:
    """c / (1 - c) for a codec that loses at most c A of a value in a block of absmax A (int8 / int4: c = 1 / 2q;
    int2: c = 1 - 1.5 / sqrt(block), its scale being at least 1.5 RMS >= 1.5 A / sqrt(block) or A): the residual
    fed with Δ loses at most c (max|Δ| + max|e|), so it never exceeds c / (1 - c) max|Δ|."""
    c = 1 / (2 * codec.qmax) if codec.name != "int2" else 1 - 1.5 / math.sqrt(codec.block)
    return c / (1 - c)


def _pseudo_grads(n: int, rounds: int, seed: int, exponents: list[int]) -> list[torch.Tensor]:
    """Random pseudo-gradients whose magnitude differs by block-sized stretch and by round."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([2.0**e for e in exponents]).repeat_interleave(-(-n // len(exponents)))[:n]
    return [torch.randn(n, generator=g) * scale * (1 + r % 3) for r in range(rounds)]


def _send(codec, fb: ErrorFeedback, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One round: (what was encoded after feeding, what the peers decode of it)."""
    flat = delta.clone()
    fb.feed(flat)
    return flat, codec.decode(codec.encode(flat), torch.empty_like(flat))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    codec=st.sampled_from(BLOCK_CODECS),
    n=st.integers(1, 700),
    rounds=st.integers(1, 30),
    seed=st.integers(0, 2**16),
    exponents=st.lists(st.integers(-20, 20), min_size=1, max_size=5),
)
def test_sent_values_sum_to_the_fed_pseudo_gradients_minus_a_bounded_residual(codec, n, rounds, seed, exponents):
    deltas = _pseudo_grads(n, rounds, seed, exponents)
    fb = ErrorFeedback(codec, torch.zeros(n), fed=n, on=True)
    fed = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    slack = torch.zeros(n, dtype=torch.float64)  # fp32 rounding of each round's Δ + e and of its residual
    biggest = torch.zeros(n)  # per value, the largest |Δ| its block saw in any round
    for delta in deltas:
        flat, decoded = _send(codec, fb, delta)
        fb.commit()
        fed += delta.double()
        sent += decoded.double()
        slack += (flat.abs() + decoded.abs()).double() * 2**-23
        residual = fb.residual
        # this round's residual: within the codec's bound for the block that was encoded (up to fp32 rounding)
        assert (residual.abs() <= _bound(codec, flat) + _per_value_absmax(codec, flat) * 2**-21 + 2**-126).all()
        assert torch.equal(residual, flat - decoded)  # exactly what the peers lost of it
        biggest = torch.maximum(biggest, _per_value_absmax(codec, delta))
    # bounded over time, not growing with the rounds (int8 / int4: max|Δ| / (2q - 1))
    assert (fb.residual.abs() <= biggest * _lasting(codec) * (1 + 2**-18) + 2**-126).all()
    # what the peers received, summed, is what was fed minus what is still owed
    assert ((sent - (fed - fb.residual.double())).abs() <= slack + 2**-126).all()


TOPK = [codec_for("topk", 16, density=0.25, value_bits=2), codec_for("topk", 64, density=1 / 32, value_bits=4)]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    codec=st.sampled_from(TOPK),
    n=st.integers(1, 300),
    rounds=st.integers(1, 20),
    seed=st.integers(0, 2**16),
    exponents=st.lists(st.integers(-20, 20), min_size=1, max_size=5),
)
def test_topk_carries_exactly_what_it_dropped_and_what_was_sent_sums_to_what_was_fed(codec, n, rounds, seed, exponents):
    fb = ErrorFeedback(codec, torch.zeros(n), fed=n, on=True)
    fed, sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    slack = torch.zeros(n, dtype=torch.float64)  # fp32 rounding of each round's Δ + e and of its residual
    for delta in _pseudo_grads(n, rounds, seed, exponents):
        flat, decoded = _send(codec, fb, delta)
        fb.commit()
        fed += delta.double()
        sent += decoded.double()
        slack += (flat.abs() + decoded.abs()).double() * 2**-23
        assert torch.equal(fb.residual, flat - decoded)  # exactly what the peers lost of it
        dropped = decoded == 0
        assert torch.equal(fb.residual[dropped], flat[dropped])  # a value not sent is carried whole
        assert int((~dropped).sum()) <= codec.k * -(-n // codec.block)
    assert ((sent - (fed - fb.residual.double())).abs() <= slack + 2**-126).all()


@pytest.mark.parametrize(
    "codec",
    [*BLOCK_CODECS[:2], codec_for("int2", block=16), FP16, BF16, TOPK[0]],
    ids=lambda c: f"{c.name}-{c.block}",
)
def test_a_failed_reduce_does_not_advance_the_residual_and_its_retry_matches_a_round_that_never_failed(codec):
    n = 300
    deltas = _pseudo_grads(n, rounds=6, seed=1, exponents=[-3, 0, 5])
    retried = ErrorFeedback(codec, torch.zeros(n), fed=n, on=True)
    clean = ErrorFeedback(codec, torch.zeros(n), fed=n, on=True)
    sent_retried = sent_clean = torch.zeros(n, dtype=torch.float64)
    for r, delta in enumerate(deltas):
        if r % 2:  # this round's reduce fails once (no commit), then is retried from a fresh pseudo-gradient
            kept = retried.residual.clone()
            _send(codec, retried, delta)
            assert torch.equal(retried.residual, kept)
        _, decoded = _send(codec, retried, delta)
        retried.commit()
        sent_retried = sent_retried + decoded.double()
        _, decoded = _send(codec, clean, delta)
        clean.commit()
        sent_clean = sent_clean + decoded.double()
        assert torch.equal(retried.residual, clean.residual)
    assert torch.equal(sent_retried, sent_clean)  # the failed attempts sent nothing twice, lost nothing
    fed = sum(d.double() for d in deltas)
    torch.testing.assert_close(sent_clean, fed - clean.residual.double(), rtol=0, atol=float(fed.abs().max()) * 2**-20)
    assert clean.residual.abs().max() > 0  # the codec is lossy here: there was something to carry


def test_the_residual_round_trips_through_load_and_only_fed_values_are_kept():
    codec = codec_for("int4", block=16)
    fb = ErrorFeedback(codec, torch.zeros(56), fed=33, on=True)  # 33 fed values, the pad, then diagnostics
    flat = torch.linspace(-1, 1, 56)
    fb.feed(flat)
    fb.commit()
    assert fb.residual.shape == (33,) and fb.residual.abs().max() > 0
    saved = fb.residual.clone()
    other = ErrorFeedback(codec, torch.zeros(56), fed=33, on=True)
    other.load(saved)
    a, b = torch.linspace(1, 2, 56), torch.linspace(1, 2, 56)
    fb.feed(a)
    other.feed(b)
    assert torch.equal(a, b) and torch.equal(a[48:], torch.linspace(1, 2, 56)[48:])  # diagnostics not fed
    assert torch.equal(a[33:48], torch.zeros(15))  # the last fed block's pad, as the codec pads it
    other.load(None)
    assert torch.equal(other.residual, torch.zeros(33))
    with pytest.raises(ValueError, match="the saved error-feedback residual has 32 values, not 33"):
        other.load(torch.zeros(32))


@pytest.mark.parametrize(("codec", "on"), [(FP32, True), (codec_for("int8"), False)], ids=["fp32", "off"])
def test_off_for_fp32_or_when_disabled_it_holds_nothing_and_changes_nothing(codec, on):
    fb = ErrorFeedback(codec, torch.zeros(100), fed=100, on=on)
    flat = torch.linspace(-1, 1, 100)
    fb.feed(flat)
    fb.commit()
    assert fb.residual is None and torch.equal(flat, torch.linspace(-1, 1, 100))

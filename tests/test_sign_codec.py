"""The 1-bit sign codec: each value's sign and one scale per block, the block's mean |x|; and error feedback
over it (what it drops, per block at most all but ||x||_1^2 / n of the squared norm, is carried, not lost).
Its round trip over random and extreme values and odd sizes is in test_codec.py, with int8's and int4's."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_core import SIGN, DiLoCo, DiLoCoConfig, codec_for, reference_mean
from diloco_core.codecs.sign import SignCodec
from diloco_core.feedback import ErrorFeedback
from transports import InProcessGroup

FP32_MAX = torch.finfo(torch.float32).max


def test_payload_is_a_32nd_of_fp32_plus_its_scales_and_the_bit_layout_is_fixed():
    assert SIGN.payload_bytes(25_000_000) / (4 * 25_000_000) == pytest.approx(1 / 32 + 1 / 256, rel=1e-3)
    x = torch.tensor([-1.0, 2, 3, -4, 5, 6, 7, -8] + [1.0] * 24)
    payload = codec_for("sign", block=32).encode(x)
    assert payload[:4].view(torch.float32).item() == pytest.approx((36 + 24) / 32)  # mean |x|
    # bit planes: a negative value 4p + m (p * block / 8 + m) sets bit p of byte m: values 0, 3 and 7
    assert payload[4:].tolist() == [0b1, 0, 0, 0b11]
    assert SIGN.layout == 2  # layout 1 (bit k of byte m for value 8m + k) never averages with it


def test_blocks_under_32_are_refused_since_side_by_side_payloads_would_misalign_their_scales():
    with pytest.raises(ValueError, match=r"block=16 is invalid for the sign codec: expected a power of two in \[32"):
        codec_for("sign", block=16)
    with pytest.raises(
        ValueError, match=r"codec_block=16 is invalid: expected a power of two in \[32, 65536\] for codec"
    ):
        DiLoCoConfig(codec="sign", codec_block=16)


@pytest.mark.parametrize("name", ["sign", "int2"])  # their scales are sums (mean |x|, RMS) in a fixed order
def test_a_block_encodes_alike_alone_and_in_a_chunk_of_many_whatever_the_threads(name):
    """Transports encode a slice that starts at a block alone; its scale must be the one the whole gave (one
    block of 65536 values alone is a sum torch would split across threads, as one row of a chunk it is not)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        codec, g = codec_for(name, block=65536), torch.Generator().manual_seed(5)
        x = torch.randn(4 * 65536 + 7, generator=g) * 100
        whole = codec.encode(x)
        for b in range(4):
            alone = codec.encode(x[b * 65536 : (b + 1) * 65536])
            assert torch.equal(alone[:4], whole[4 * b : 4 * b + 4])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [256, 100, 300])  # a whole block, a partial one, both
def test_values_past_fp32s_max_in_sum_still_give_a_finite_mean_magnitude(n):
    x = torch.full((n,), FP32_MAX)
    x[::2] = -FP32_MAX
    x[-1] = 1.0  # a block whose sum does not overflow keeps the plain mean
    got = SIGN.decode(SIGN.encode(x), torch.empty(n))
    assert torch.isfinite(got).all() and torch.equal(torch.signbit(got), torch.signbit(x))
    for values, decoded in zip(x.split(256), got.split(256)):
        assert decoded.abs().max().item() == pytest.approx(values.double().abs().mean().item(), rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_infinite_input_is_a_clear_error(bad):
    x = torch.randn(1000)
    x[700] = bad
    with pytest.raises(ValueError, match=r"sign cannot encode NaN or infinite values \(one is in \[0, 1000\)\)"):
        SIGN.encode(x)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_a_received_payload_with_a_bad_scale_is_refused(scale):
    payload = SIGN.encode(torch.randn(300))
    payload[:4] = torch.tensor([scale]).view(torch.uint8)
    with pytest.raises(ValueError, match="NaN, infinite or negative scale"):
        SIGN.mean_of([payload, SIGN.encode(torch.randn(300))], torch.empty(300))


def test_copies_and_other_blocks_stay_sign_codecs_and_bits_other_than_1_are_refused():
    for codec in (pickle.loads(pickle.dumps(SIGN)), codec_for("sign", block=64)):
        assert isinstance(codec, SignCodec) and codec.bits == 1
    assert codec_for("sign", block=64).block == 64
    with pytest.raises(ValueError, match="bits=4 is invalid: the sign codec sends 1 bit per value"):
        SignCodec("sign", bits=4)


def test_the_mean_of_payloads_is_the_reference_mean_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2**20 + 999, generator=g) * (r + 1) for r in range(3)]  # chunks, a partial last block
    out = SIGN.mean_of([SIGN.encode(x) for x in xs], torch.empty(xs[0].numel()))
    assert torch.equal(out, reference_mean(xs, SIGN))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    block=st.sampled_from([32, 256]),
    n=st.integers(1, 700),
    rounds=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    exponent=st.integers(-20, 20),
)
def test_error_feedback_sends_the_fed_sum_minus_a_residual_that_stays_bounded(block, n, rounds, seed, exponent):
    codec, g = codec_for("sign", block=block), torch.Generator().manual_seed(seed)
    fb = ErrorFeedback(codec, torch.zeros(n), fed=n, on=True)
    fed, sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    slack = torch.zeros(n, dtype=torch.float64)
    biggest = torch.zeros(-(-n // block), dtype=torch.float64)  # per block, the largest ||Δ|| of any round
    for r in range(rounds):
        delta = torch.randn(n, generator=g) * 2.0**exponent * (1 + r % 3)
        flat = delta.clone()
        fb.feed(flat)
        decoded = codec.decode(codec.encode(flat), torch.empty(n))
        fb.commit()
        assert torch.equal(fb.residual, flat - decoded)  # exactly what the peers lost of it
        fed += delta.double()
        sent += decoded.double()
        slack += (flat.abs() + decoded.abs()).double() * 2**-22
        norms = torch.stack([b.double().norm() for b in delta.split(block)])
        biggest = torch.maximum(biggest, norms)
    # per block the codec keeps ||x||_1^2 / n of the squared norm, so ||e'|| <= s (||Δ|| + ||e||) with
    # s = sqrt(1 - 1/n): the residual never exceeds s / (1 - s) times the largest block norm fed
    for residual, top in zip(fb.residual.double().split(block), biggest):
        s = math.sqrt(1 - 1 / residual.numel())
        assert residual.norm() <= s / (1 - s) * top * (1 + 1e-4) + 1e-30
    assert ((sent - (fed - fb.residual.double())).abs() <= slack + 2**-126).all()


@pytest.mark.parametrize("feedback", [False, True])
def test_a_fragments_partial_last_block_is_scaled_by_its_own_values_not_the_padding(feedback):
    """docs/codecs.md: a partial last block's scale is the mean |x| over its own values. Inside DiLoCo the
    reduce buffer pads the pseudo-gradient's last block; a 257-value parameter at block 256 moved its last
    value by 1/256 of its step before (the pad's zeros counted), now by the step itself."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(257))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, codec="sign", error_feedback=feedback)
    dl = DiLoCo(model, opt, InProcessGroup(1).transport(0), config)
    step = torch.linspace(-2.0, 3.0, 257)
    step[256] = 5.0  # alone in its block: its own mean |x| is 5
    model.w.grad = -step  # the inner SGD moves w by +step
    dl.step()
    moved = model.w.detach()
    assert moved[256].item() == pytest.approx(5.0, rel=1e-6)  # 5 / 256 before
    sign = codec_for("sign")
    assert torch.equal(moved[:256], sign.decode(sign.encode(step[:256]), torch.empty(256)))

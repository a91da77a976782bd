"""The 2-bit codec: one scale per block, min(absmax, 1.5 RMS), and each value's nearest of +-scale / 3, +-scale.
Its round trip over random and extreme values and odd sizes is in test_codec.py, with int8's and int4's; its
error feedback in test_feedback.py."""

from __future__ import annotations

import pickle

import pytest
import torch

from diloco_core import DiLoCo, DiLoCoConfig, codec_for
from diloco_core.codecs.int2 import Int2Codec
from diloco_core.codecs.names import INT2, SIGN
from transports import InProcessGroup

THIRD = torch.tensor(1 / 3, dtype=torch.float32).item()


def test_payload_is_a_16th_of_fp32_plus_its_scales_and_the_layout_is_fixed():
    assert INT2.payload_bytes(25_000_000) / (4 * 25_000_000) == pytest.approx(1 / 16 + 1 / 256, rel=1e-3)
    spread = [3.0, -3, 1, -1, 2.1, -2.1, 0, -0.5] + [3.0] * 4 + [-3.0] * 4  # 1.5 RMS > absmax: scale 3
    outlier = [10.0] + [1.0] * 15  # 1.5 RMS = 15 sqrt(1.15 / 16) < absmax: scale 4.02, 10 clipped to it
    payload = codec_for("int2", block=16).encode(torch.tensor(spread + outlier))
    scales = payload[:8].view(torch.float32)
    assert scales[0].item() == 3.0 and scales[1].item() == pytest.approx(15 * (1.15 / 16) ** 0.5, rel=1e-6)
    # quarters: value 4p + m's code k (level (2k - 3) / 3) in bits 2p, 2p + 1 of byte m
    assert payload[8:12].tolist() == [3 | 3 << 2 | 3 << 4, 3 << 4, 2 | 2 << 2 | 3 << 4, 1 | 1 << 2 | 3 << 4]
    assert payload[12:].tolist() == [3 | 0b10101000, 0b10101010, 0b10101010, 0b10101010]
    got = codec_for("int2", block=16).decode(payload, torch.empty(32))
    assert got[:16].tolist() == [3.0, -3, 1, -1] * 2 + [3.0] * 4 + [-3.0] * 4
    assert torch.equal(got[16:], scales[1] * torch.tensor([1.0] + [THIRD] * 15))


@pytest.mark.parametrize("n", [16, 5, 300])  # a whole block, a partial one, both
def test_blocks_of_one_value_decode_exactly_and_zeros_to_plus_zero(n):
    """The contribution guard writes blocks of one value (valid flag, work, digest) and reads them back."""
    for v in (1.0, -0.7, 0.3, 15.0, 225.0, 1e-45, -3e38, torch.finfo(torch.float32).max, 0.0, -0.0):
        x = torch.full((n,), v)
        got = codec_for("int2", block=16).decode(codec_for("int2", block=16).encode(x), torch.empty(n))
        assert torch.equal(got, x) and not torch.signbit(got[x == 0]).any(), v
    x = torch.tensor([2.0, 0.0, -0.0, -2.0] * 4)  # zeros inside a nonzero block (scale 2): the level above
    got = codec_for("int2", block=16).decode(codec_for("int2", block=16).encode(x), torch.empty(16))
    assert got[1].item() == got[2].item() == 2.0 * THIRD


def test_it_loses_a_third_of_what_sign_loses_of_gaussian_blocks_and_less_than_sign_of_heavy_tails():
    """The scale is 1.5 RMS, not the absmax: with the absmax (levels +-absmax / 3, +-absmax) it lost 36% of a
    Gaussian block's squared norm (sign: 36%), 106% of a Laplace one's (sign: 50%)."""
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(2**16, generator=g)
    laplace = torch.log(torch.rand(2**16, generator=g)) * torch.sign(torch.randn(2**16, generator=g))
    for x, most in ((gauss, 0.13), (laplace, 0.21)):
        lost = {
            c.name: float((c.decode(c.encode(x), torch.empty_like(x)) - x).square().sum() / x.square().sum())
            for c in (INT2, SIGN)
        }
        assert lost["int2"] <= most and lost["int2"] <= lost["sign"] / 2, lost


def test_copies_and_other_blocks_stay_int2_codecs_and_bad_settings_are_refused():
    x = torch.randn(1000)
    for codec in (pickle.loads(pickle.dumps(INT2)), codec_for("int2", block=64)):
        assert isinstance(codec, Int2Codec) and codec.bits == 2 and codec.fused is False
    assert torch.equal(pickle.loads(pickle.dumps(INT2)).encode(x), INT2.encode(x))  # a process's averager's copy
    assert codec_for("int2", block=16).payload_bytes(16) == 8  # side by side, every scale stays aligned
    with pytest.raises(ValueError, match="bits=4 is invalid: the int2 codec sends 2 bits per value"):
        Int2Codec("int2", bits=4)
    with pytest.raises(ValueError, match=r"codec_block=8 is invalid: expected a power of two in \[16, 65536\]"):
        DiLoCoConfig(codec="int2", codec_block=8)


def test_a_fragments_partial_last_block_is_scaled_by_its_own_values_not_the_padding():
    """Inside DiLoCo the reduce buffer pads the pseudo-gradient's last block: with zeros there a 257-value
    parameter's last value, alone in its block, would have moved by 1.5 / 16 of its step (the RMS counting 255
    zeros); the padding holds its own RMS: it moves by the step itself."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(257))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, codec="int2", error_feedback=False)
    dl = DiLoCo(model, opt, InProcessGroup(1).transport(0), config)
    step = torch.linspace(-2.0, 3.0, 257)
    step[256] = 5.0
    model.w.grad = -step  # the inner SGD moves w by +step
    dl.step()
    moved = model.w.detach()
    assert moved[256].item() == 5.0
    assert torch.equal(moved[:256], INT2.decode(INT2.encode(step[:256]), torch.empty(256)))

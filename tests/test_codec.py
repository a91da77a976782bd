"""The codecs: payload shapes, round trips, input checks, and the reference mean built on them."""

from __future__ import annotations

import pytest
import torch

from diloco_core import BF16, CODECS, FP16, FP32, codec_for, mean_of_payloads, reference_mean
from diloco_core.codec import check_codec


@pytest.mark.parametrize("codec", [FP32, FP16, BF16], ids=lambda c: c.name)
def test_cast_codecs_round_trip_to_the_rounded_values(codec):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    payload = codec.encode(x)
    assert codec.payload_spec(1000) == (1000, codec.elementwise_dtype) == (payload.numel(), payload.dtype)
    assert codec.payload_bytes(1000) == 1000 * codec.elementwise_dtype.itemsize
    codec.check(payload, 1000)
    out = codec.decode(payload, torch.empty(1000))
    assert torch.equal(out, x.to(codec.elementwise_dtype).float())
    into = torch.ones(1000)
    codec.add_decoded(payload, into, scratch=torch.empty(1000))
    assert torch.equal(into, torch.ones(1000) + out)


def test_received_payloads_are_checked():
    good = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(ValueError, match="4 x torch.float16"):
        FP16.check(torch.zeros(5, dtype=torch.float16), 4)
    with pytest.raises(ValueError, match="float32"):
        FP16.check(torch.zeros(4), 4)
    with pytest.raises(ValueError, match="NaN or infinite"):
        FP16.check(torch.tensor([0.0, float("inf"), 0.0, 0.0], dtype=torch.float16), 4)
    FP16.check(good, 4)


def test_codecs_by_name_and_clear_errors():
    assert {n: codec_for(n) for n in ("fp32", "fp16", "bf16")} == CODECS
    assert codec_for(FP16) is FP16
    with pytest.raises(ValueError, match=r"wire_dtype='int3' is invalid: expected one of \['bf16', 'fp16', 'fp32'\]"):
        codec_for("int3")
    assert check_codec(BF16) is BF16
    with pytest.raises(ValueError, match="codec='fp16' is invalid: expected a Codec"):
        check_codec("fp16")


def test_reference_mean_sums_decoded_payloads_in_order_in_fp32():
    xs = [torch.tensor([1.0, 2.0**-11, 3.0]), torch.tensor([1e-4, 1.0, -3.0]), torch.tensor([0.5, 0.5, 0.5])]
    got = reference_mean(xs, "fp16")
    wire = [x.half().float() for x in xs]
    assert torch.equal(got, ((wire[0] + wire[1]) + wire[2]) / 3)
    out = torch.empty(3)
    assert mean_of_payloads([FP16.encode(x) for x in xs], FP16, out=out) is out and torch.equal(out, got)
    assert torch.equal(reference_mean(xs, FP32), ((xs[0] + xs[1]) + xs[2]) / 3)

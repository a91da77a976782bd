"""The block codecs' fused CPU kernels (``diloco_core.codecs.kernels``) give the eager code's payloads, means and
decodes bit for bit, and a codec stays eager (and correct) where a kernel cannot be compiled."""

from __future__ import annotations

import copy
import logging
import pickle
import threading

import pytest
import torch

from diloco_core import reference_mean
from diloco_core.codecs import kernels as codec_kernels
from diloco_core.codecs.block import BlockCodec
from diloco_core.codecs.kernels import BUILD_MIN_VALUES, MIN_VALUES, kernels_available
from diloco_core.codecs.sign import SignCodec

pytestmark = pytest.mark.skipif(
    not kernels_available(torch.device("cpu")), reason="no C++ compiler for Inductor: the codecs run eagerly"
)


def _hard_values(n: int, seed: int) -> torch.Tensor:
    """Gaussians over 10+ orders of magnitude, with all-zero, subnormal, near-fp32-max and -0.0 blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x[:4096] = 0.0
    x[5000:9000] *= 1e-40  # subnormal: their scales are too
    x[20000:20256] = 3e38  # absmax / 127 rounds up: the encode steps its scale down
    x[30000:30256] *= -1e30
    x[40000:40100] = -0.0
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # -0.0 and +0.0 differ, NaNs compare


def _codec(bits: int, block: int, *, fused: bool) -> BlockCodec:
    codec = SignCodec(block=block) if bits == 1 else BlockCodec(f"int{bits}", bits, block)
    codec.fused = fused
    return codec


@pytest.mark.parametrize(
    ("bits", "block"),
    [
        # the default codec (int4) and the 1-bit kernel in the default run; each other kernel costs an Inductor
        # compile of ~5 s (-m slow)
        pytest.param(8, 256, marks=pytest.mark.slow),
        (4, 256),
        pytest.param(4, 32, marks=pytest.mark.slow),
        pytest.param(8, 65536, marks=pytest.mark.slow),
        pytest.param(1, 256, marks=pytest.mark.slow),
        (1, 32),
    ],
)
@pytest.mark.parametrize("n", [MIN_VALUES, 2**20 + 2**18 + 777, 3 * 2**20])
def test_fused_kernels_equal_the_eager_code_bit_for_bit(bits, block, n):
    fused, eager = _codec(bits, block, fused=True), _codec(bits, block, fused=False)
    fused.prepare(torch.empty(()).expand(BUILD_MIN_VALUES), payloads=(2, 3))  # as for a model this large
    assert (
        fused._fused(fused._encoding, torch.device("cpu"), n) is not None
    )  # the kernels do run here (sign: its packing)
    assert all(fused._fused("mean", torch.device("cpu"), n, payloads=k) is not None for k in (1, 2, 3))
    xs = [_hard_values(n, seed) for seed in range(3)]
    payloads = [fused.encode(x) for x in xs]
    for p, x in zip(payloads, xs):
        assert torch.equal(p, eager.encode(x))
    for k in (1, 2, 3):
        got, want = torch.empty(n), torch.empty(n)
        fused.mean_of(payloads[:k], got)
        eager.mean_of(payloads[:k], want)
        assert torch.equal(_bits(got), _bits(want)), k
    got, want = torch.empty(n), torch.empty(n)
    assert torch.equal(_bits(fused.decode(payloads[0], got)), _bits(eager.decode(payloads[0], want)))
    assert torch.equal(_bits(reference_mean(xs, fused)), _bits(reference_mean(xs, eager)))
    stop = n - block - 5  # what the robust merge judges: pieces to a stop inside a block, kernel-decoded
    got = torch.cat([p.clone() for p in fused.pieces(payloads, n, span=range(stop), size=2**15)], dim=1)
    want = torch.cat([p.clone() for p in eager.pieces(payloads, n, span=range(stop), size=2**15)], dim=1)
    assert got.shape == (3, stop) and torch.equal(_bits(got), _bits(want))


def test_a_slice_encodes_and_averages_as_its_part_of_the_whole_with_kernels():
    """A transport encodes buckets on their own (kernel for some chunks, eager for a tail): each bucket's
    payload decodes to that slice of the whole's decoded values."""
    codec, n, cut = BlockCodec("int4", 4), 3 * 2**20 + 300, 1_999_872  # a bucket of 8 MB, block-aligned
    x = _hard_values(n, 7)
    whole = codec.decode(codec.encode(x), torch.empty(n))
    for start in range(0, n, cut):
        part = x[start : start + cut]
        assert torch.equal(
            _bits(codec.decode(codec.encode(part), torch.empty(part.numel()))), _bits(whole[start : start + cut])
        )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_input_still_raises_with_kernels(bad):
    codec = BlockCodec("int8", 8)
    codec.prepare(torch.empty(()).expand(BUILD_MIN_VALUES))
    assert codec._fused(codec._encoding, torch.device("cpu"), 2**21) is not None
    x = torch.randn(2**21)
    x[1_123_456] = bad  # in the second chunk: the first is encoded by the kernel before it
    with pytest.raises(
        ValueError, match=r"int8 cannot encode NaN or infinite values \(one is in \[1048576, 2097152\)\)"
    ):
        codec.encode(x)


def test_copies_keep_the_choice_of_kernels():
    eager = BlockCodec("int4", 4, fused=False)
    assert pickle.loads(pickle.dumps(eager)).fused is False
    assert copy.copy(eager).fused is False
    assert eager.with_block(64).fused is False
    assert BlockCodec("int4", 4).with_block(64).fused is True


def test_a_kernel_that_does_not_compile_leaves_the_codec_eager(caplog):
    def broken(src, scales, *, bits):
        raise RuntimeError("no compiler here")

    with caplog.at_level(logging.WARNING, logger="diloco_core.codecs.kernels"):
        assert codec_kernels._compile(broken, [torch.zeros(4, 256), torch.zeros(4)], bits=8) is False
    assert "codec kernels unavailable, using eager torch (" in caplog.text


def test_small_tensors_and_other_devices_stay_eager():
    codec, cpu, meta = BlockCodec("int8", 8), torch.device("cpu"), torch.device("meta")
    codec.prepare(torch.empty(()).expand(BUILD_MIN_VALUES))
    assert (
        codec._fused("mean", cpu, MIN_VALUES, payloads=2) is not None
        and codec._fused(codec._encoding, cpu, MIN_VALUES) is not None
    )
    assert (
        codec._fused("mean", cpu, MIN_VALUES - 1, payloads=2) is None
        and codec._fused(codec._encoding, cpu, MIN_VALUES - 1) is None
    )
    assert (
        codec._fused("mean", meta, MIN_VALUES, payloads=2) is None
        and codec._fused(codec._encoding, meta, MIN_VALUES) is None
    )
    eager = BlockCodec("int8", 8, fused=False)
    assert (
        eager._fused("mean", cpu, MIN_VALUES, payloads=2) is None
        and eager._fused(eager._encoding, cpu, MIN_VALUES) is None
    )


def test_kernels_do_not_recompile_for_another_threads_grad_mode_or_thread_count():
    """A hivemind averager encodes and averages in executor threads of a forked process: a kernel guarded on
    the compiling thread's grad mode or torch's thread count recompiled there, for seconds, in a round."""
    from torch._dynamo.utils import counters

    codec, n = SignCodec(), MIN_VALUES
    codec.prepare(torch.empty(()).expand(BUILD_MIN_VALUES))
    x, out, threads = torch.randn(n), torch.empty(n), torch.get_num_threads()
    payload = codec.encode(x)  # warm: any first-call work done
    graphs = counters["stats"]["unique_graphs"]

    def calls() -> None:
        with torch.no_grad():
            assert (
                codec._fused(codec._encoding, x.device, n) is not None
                and codec._fused("mean", x.device, n, payloads=2) is not None
            )
            codec.mean_of([codec.encode(x), payload], out)

    worker = threading.Thread(target=calls)
    worker.start()
    worker.join(60)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        calls()
    finally:
        torch.set_num_threads(threads)
    assert counters["stats"]["unique_graphs"] == graphs


def test_in_inference_mode_the_codecs_stay_eager_and_exact():
    """Inference tensors carry other dispatch keys: a kernel would recompile for them, so none is used."""
    codec, n = BlockCodec("int4", 4), MIN_VALUES
    codec.prepare(torch.empty(()).expand(BUILD_MIN_VALUES))
    eager = BlockCodec("int4", 4, fused=False)
    x = torch.randn(n)
    with torch.inference_mode():
        assert (
            codec._fused(codec._encoding, x.device, n) is None and codec._fused("mean", x.device, n, payloads=2) is None
        )
        payload, out = codec.encode(x), torch.empty(n)
        assert torch.equal(payload, eager.encode(x))
        assert torch.equal(codec.mean_of([payload, payload], out), eager.mean_of([payload, payload], torch.empty(n)))


def test_a_negative_zero_sign_scale_decodes_alike_with_and_without_kernels():
    """``check`` lets a -0.0 scale through (-0.0 >= 0); eager ORs the sign bit in, so the kernel must give -0.0 too."""
    codec, n = SignCodec(), MIN_VALUES
    codec.prepare(torch.empty(()).expand(BUILD_MIN_VALUES))
    eager = _codec(1, 256, fused=False)
    payload = codec.encode(torch.randn(n))
    payload[: 4 * 8].view(torch.float32)[:] = -0.0  # the first 8 blocks' scales
    got, want = codec.mean_of([payload], torch.empty(n)), eager.mean_of([payload], torch.empty(n))
    assert torch.equal(_bits(got), _bits(want))

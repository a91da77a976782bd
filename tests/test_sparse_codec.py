"""The sparse codec (topk): which values it keeps, how close they decode, its payload checks and its settings."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_core import CODECS, DiLoCoConfig, codec_for, reference_mean
from diloco_core.codecs.names import codec_of
from diloco_core.codecs.sparse import TopKCodec

FP32_MAX = torch.finfo(torch.float32).max
CODECS_UNDER_TEST = [
    codec_for("topk"),  # 4 of 256 in 2 bits
    codec_for("topk", 16, density=0.25, value_bits=4),  # 4 of 16
    codec_for("topk", 32, density=1 / 64, value_bits=2),  # 1 of 32: only the largest, exact
    codec_for("topk", 64, density=0.5, value_bits=4),  # half of each block
]
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
extremes = st.sampled_from([0.0, -0.0, 1e-45, -1e-38, 1.0, -1.0, 3.0, 1e30, -1e38, FP32_MAX, -FP32_MAX])


def _blocks(codec: TopKCodec, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, -x.numel() % codec.block)).view(-1, codec.block)


def _check_round_trip(codec: TopKCodec, x: torch.Tensor) -> None:
    """Each block keeps its k values of largest |x|, the lowest index first among ties; every other value decodes
    to +0.0; a kept value within scale / (2^bits - 1) of itself, the block's largest exactly."""
    got = codec.decode(codec.encode(x), torch.empty(x.numel()))
    assert not bool((got.view(torch.int32) == -(2**31)).any())  # no -0.0
    steps = 2**codec.value_bits - 1
    for values, decoded in zip(_blocks(codec, x), _blocks(codec, got)):
        kept = torch.zeros(codec.block, dtype=torch.bool)
        kept[torch.sort(-values.abs(), stable=True).indices[: codec.k]] = True  # the tie rule, written plainly
        assert torch.equal(decoded[~kept], torch.zeros_like(decoded[~kept]))
        assert (values[~kept].abs() <= values[kept].abs().min()).all()  # nothing dropped is larger than kept
        scale = values.abs().max().double()
        error = (decoded[kept].double() - values[kept].double()).abs()
        assert (error <= scale / steps * (1 + 2**-20) + 2**-126).all()
        top = int(torch.argmax(values.abs()))  # the first of the largest
        assert decoded[top] == values[top] or (values[top] == 0 and decoded[top].view(torch.int32) == 0)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    values=st.lists(finite, max_size=400) | st.lists(extremes, max_size=80),
    codec=st.sampled_from(CODECS_UNDER_TEST),
    start_block=st.integers(0, 3),
)
def test_each_block_keeps_its_largest_values_first_index_first_within_their_bound(values, codec, start_block):
    x = torch.tensor(values, dtype=torch.float32)
    _check_round_trip(codec, x)
    whole = codec.decode(codec.encode(x), torch.empty(x.numel()))
    # a slice that starts at a block boundary encodes as its part of the whole (transports cut there)
    start = min(start_block * codec.block, x.numel())
    assert torch.equal(codec.decode(codec.encode(x[start:]), torch.empty(x.numel() - start)), whole[start:])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    codec=st.sampled_from(CODECS_UNDER_TEST),
    n=st.integers(0, 700),
    k=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_mean_of_is_the_reference_mean_bit_for_bit(codec, n, k, seed, ties):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) * 10 ** float(torch.randint(-3, 4, (), generator=g)) for _ in range(k)]
    if ties:  # few distinct magnitudes: ties decide what is kept
        xs = [x.sign() * x.abs().ceil().clamp(max=3) for x in xs]
    out = torch.full((n,), float("nan"))
    assert codec.mean_of([codec.encode(x) for x in xs], out) is out
    assert torch.equal(out, reference_mean(xs, codec))


def test_a_payload_of_several_chunks_decodes_chunk_by_chunk_to_the_reference_mean():
    """Decoding unpacks a chunk of blocks at a time (its bits as int64: the dense size): the chunks' seams, a
    partial last block and three payloads summed in order give the plain definition's bits."""
    codec, g = codec_for("topk", 256), torch.Generator().manual_seed(3)
    xs = [torch.randn(2**20 + 300, generator=g) for _ in range(3)]
    payloads = [codec.encode(x) for x in xs]
    for p in payloads:
        codec.check(p, xs[0].numel())
    got = codec.mean_of(payloads, torch.empty(xs[0].numel()))
    assert torch.equal(got, reference_mean(xs, codec))


@pytest.mark.parametrize("codec", CODECS_UNDER_TEST, ids=lambda c: str(c.identity))
@pytest.mark.parametrize("value", [1.0, -0.3, 3.0, 9.0, 0.0, -0.0, 1e-40, -FP32_MAX])
def test_a_block_of_one_repeated_value_decodes_exactly_at_its_first_value(codec, value):
    """The contribution guard's tail (valid flag, work - 1, digest and its square: a block each, then the RMS, a
    block of one) is read at each block's first value."""
    b, want = codec.block, torch.tensor(value) + 0.0  # -0.0 decodes to +0.0
    x = torch.cat([torch.randn(b), torch.full((b,), value), torch.full((1,), value)])
    got = codec.decode(codec.encode(x), torch.empty(x.numel()))
    assert torch.equal(got[b : b + codec.k].view(torch.int32), want.expand(codec.k).view(torch.int32))
    assert torch.equal(got[b + codec.k : 2 * b].view(torch.int32), torch.zeros(b - codec.k, dtype=torch.int32))
    assert got[-1].view(torch.int32) == want.view(torch.int32)


def test_payload_sizes_and_identity():
    c = codec_for("topk")
    assert (c.k, c.width, c.code_bytes) == (4, 10, 5) and c.payload_spec(1000) == (4 * 9, torch.uint8)
    assert codec_for("topk", 4096, density=1 / 32, value_bits=4).payload_spec(4096) == (4 + 128 * 2, torch.uint8)
    assert c.payload_spec(0) == (0, torch.uint8) and c.encode(torch.empty(0)).numel() == 0
    assert codec_for("topk") is CODECS["topk"] and codec_for("topk", 256, density=1 / 64, value_bits=2) is c
    ids = {str(codec_for("topk", b, density=d, value_bits=v).identity) for b in (256, 4096) for d in (1 / 64, 1 / 32)
           for v in (2, 4)}  # fmt: skip
    assert "topk2k4b256" in ids and "topk4k128b4096" in ids and len(ids) == 8  # peers differing never average
    assert str(codec_for("int4").identity) == "int4b256v2" and str(codec_for("fp16").identity) == "fp16"
    assert codec_for("topk", 64).with_block(256).identity == c.identity
    copy = pickle.loads(pickle.dumps(codec_for("topk", 32, density=0.25, value_bits=4)))
    assert copy.identity == codec_for("topk", 32, density=0.25, value_bits=4).identity
    x = torch.randn(100)
    assert torch.equal(copy.encode(x), codec_for("topk", 32, density=0.25, value_bits=4).encode(x))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density": 0}, r"density=0 is invalid: expected a number in \(0, 0.5\]"),
        ({"density": 0.6}, r"density=0.6 is invalid"),
        ({"density": True}, r"density=True is invalid"),
        ({"value_bits": 3}, r"value_bits=3 is invalid: expected 2 or 4"),
        ({"value_bits": 2.0}, r"value_bits=2.0 is invalid"),
        ({"block": 16}, r"density=0.015625 is invalid at block=16: .* expected a density >= 0.03125"),
        ({"block": 100}, r"block=100 is invalid: expected a power of two"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKCodec(**kwargs)


def test_config_settings_are_checked_and_build_the_codec():
    cfg = DiLoCoConfig(codec="topk", codec_block=4096, codec_density=1 / 32, codec_value_bits=4)
    assert str(codec_of(cfg).identity) == "topk4k128b4096"
    assert codec_of(DiLoCoConfig()) is CODECS["fp32"] and str(codec_of(DiLoCoConfig(codec="topk")).identity) == (
        "topk2k4b256"
    )
    for field, value, match in [
        ("codec_density", 0.0, r"codec_density=0.0 is invalid: expected a number in \(0, 0.5\]"),
        ("codec_density", 0.75, r"codec_density=0.75 is invalid"),
        ("codec_value_bits", 8, r"codec_value_bits=8 is invalid: expected 2 or 4"),
    ]:
        with pytest.raises(ValueError, match=match):
            DiLoCoConfig(codec="topk", **{field: value})
    with pytest.raises(
        ValueError, match=r"codec_density=0.015625 is invalid: expected a number in \[0.03125, 0.5\] at"
    ):
        DiLoCoConfig(codec="topk", codec_block=16)
    DiLoCoConfig(codec="topk", codec_block=32)  # density * block = 0.5: one value per block


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused_naming_where(bad):
    x = torch.randn(1000)
    x[700] = bad
    with pytest.raises(ValueError, match=r"topk cannot encode NaN or infinite values \(one is in \[512, 768\)\)"):
        codec_for("topk").encode(x)


def test_malformed_payloads_are_refused():
    c, n = codec_for("topk", 16, density=0.25, value_bits=2), 40  # 3 blocks, the last of 8 values
    payload = c.encode(torch.arange(n, dtype=torch.float32) * (-1) ** torch.arange(n))
    c.check(payload, n)
    with pytest.raises(ValueError, match="payload of 40 values must be"):
        c.check(payload[:-1], n)
    with pytest.raises(ValueError, match="torch.uint8"):
        c.check(payload.view(torch.int8), n)
    for bad in (float("nan"), float("inf"), -1.0):
        corrupt = payload.clone()
        corrupt[4:8].view(torch.float32).fill_(bad)  # the second block's scale
        with pytest.raises(ValueError, match="NaN, infinite or negative scale"):
            c.check(corrupt, n)
        with pytest.raises(ValueError, match="NaN, infinite or negative scale"):  # never a silently wrong mean
            c.mean_of([payload, corrupt], torch.empty(n))
    # block 16, k = 4: 4 fields of 6 bits, index << 2 | code, from bit 0 of a block's 3 code bytes on
    codes = payload[12:].view(3, 3)
    codes[0] = _fields([0, 2, 2, 5])
    with pytest.raises(ValueError, match="not strictly increasing"):
        c.check(payload, n)
    c.check(c.encode(torch.ones(3)), 3)  # fewer values than k: the padding fills the rest (indices 0 to 3)
    last = c.encode(torch.tensor([0, 0, 0, 0, 1.0]))  # the last value and the first three zeros
    assert torch.equal(last[4:], _fields([0, 1, 2, 4], codes=[0, 0, 0, 1]))  # zeros at +1/3 of the scale, 1 at 1
    last[4:] = _fields([0, 1, 2, 15])
    with pytest.raises(ValueError, match="past the last block's 5 values"):
        c.check(last, 5)


def _fields(indices: list[int], codes: list[int] = (0, 0, 0, 0)) -> torch.Tensor:
    """4 fields of 6 bits (block 16, 2 bits a value) as the codec packs them: 3 bytes, the first field lowest."""
    stream = sum(((i << 2) | code) << (6 * f) for f, (i, code) in enumerate(zip(indices, codes)))
    return torch.tensor(list(stream.to_bytes(3, "little")), dtype=torch.uint8)

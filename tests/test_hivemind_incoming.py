"""A downloaded state's tensors assembled as their parts arrive (transports/hivemind/incoming.py):
the same tensors as hivemind's own combine, written into shared memory on the way; a donor that
sends more or fewer bytes than it declares, or declares a shape no tensor has, is refused."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import (
    Float16Compression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from transports.hivemind.incoming import Incoming

CHUNK = 1000
"""Bytes per part: not a multiple of any dtype's size, so values are cut across parts."""


def _parts(t: torch.Tensor, compression=None) -> list[runtime_pb2.Tensor]:
    kind = runtime_pb2.CompressionType.NONE if compression is None else compression
    return list(split_for_streaming(serialize_torch_tensor(t, kind), chunk_size_bytes=CHUNK))


def _assembled(parts: list[runtime_pb2.Tensor]) -> torch.Tensor:
    incoming = Incoming(parts[0])
    for part in parts[1:]:
        incoming.add(part)
    return incoming.done()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(37, 29, generator=torch.Generator().manual_seed(0)),
        torch.randn(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
        torch.randn(3, 700, generator=torch.Generator().manual_seed(2)).half(),
        torch.arange(-900, 900, dtype=torch.int64),
        torch.tensor(3.5),
        torch.empty(0, 4),
        # hivemind's combine
        torch.randn(999, generator=torch.Generator().manual_seed(3)).bfloat16(),
    ],
    ids=["fp32", "fp64", "fp16", "int64", "scalar", "empty", "bf16"],
)
def test_parts_assemble_to_what_hivemind_s_combine_gives(tensor):
    parts = _parts(tensor)
    mine = _assembled(parts)
    theirs = deserialize_torch_tensor(combine_from_streaming(parts))
    assert mine.dtype == theirs.dtype == tensor.dtype and mine.shape == theirs.shape == tensor.shape
    assert torch.equal(mine, theirs) and torch.equal(mine, tensor)
    if tensor.dtype != torch.bfloat16:  # in shared memory as it came: no copy on the way out
        assert mine.is_shared()


def test_a_compressed_tensor_is_combined_as_hivemind_does():
    t = torch.randn(2000, generator=torch.Generator().manual_seed(4))
    parts = _parts(t, runtime_pb2.CompressionType.FLOAT16)
    theirs = Float16Compression().extract(combine_from_streaming(parts))
    assert torch.equal(_assembled(parts), theirs)


def test_a_tensor_cut_short_or_sent_long_is_refused():
    parts = _parts(torch.randn(2000, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="sent 7000 of its 8000 bytes"):
        _assembled(parts[:-1])
    with pytest.raises(ValueError, match="more than its 8000 bytes"):
        _assembled([*parts, parts[1]])


def test_a_declared_shape_no_tensor_has_is_refused_before_anything_is_allocated():
    first = _parts(torch.randn(10))[0]
    bad = runtime_pb2.Tensor()
    bad.CopyFrom(first)
    del bad.size[:]
    bad.size.extend([2**30, 2**30])  # 4 EiB of fp32 (the message's sizes are unsigned)
    with pytest.raises(ValueError, match="declares shape"):
        Incoming(bad)
    with pytest.raises(ValueError, match="without its dtype"):
        Incoming(runtime_pb2.Tensor(buffer=b"1234"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_a_donor_s_parts_read_alike_by_hivemind_and_by_incoming(dtype):
    """``serving.parts_of``: slices of the tensor's own bytes, in hivemind's messages."""
    from transports.hivemind.serving import parts_of

    t = (torch.randn(3001, generator=torch.Generator().manual_seed(6)) * 100).to(dtype)
    parts = list(parts_of(t, size=CHUNK))
    assert len(parts) == parts[0].chunks == -(-t.numel() * t.element_size() // CHUNK)
    assert torch.equal(deserialize_torch_tensor(combine_from_streaming(parts)), t)
    assert torch.equal(_assembled(parts), t)
    assert torch.equal(_assembled(list(parts_of(t[:0], size=CHUNK))), t[:0])

"""A tensor of a downloaded state as its parts arrive (``serving.parts_of``'s, or hivemind's
``split_for_streaming``'s: the first part holds the dtype, shape and compression, every part a slice
of the serialized bytes).

hivemind's own way joins every part into one ``bytes`` after the last one arrives, copies that into
its message, then into a ``bytearray`` for numpy, and the result is copied into shared memory once
more on its way to the training process (``MPFuture``): about 4 s after the last byte of a 150M
model's 0.6 GB state on 2 cores, and about 3 GB held at once. An uncompressed tensor of a plain
dtype is written here into a shared-memory tensor as its parts come instead: nothing is left to do
after the last byte, and the training process maps the same pages. Anything else (compressed,
bfloat16, whose bytes per value hivemind infers from the size) is combined as hivemind does.
"""

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming

__all__ = ["Incoming"]

DIRECT = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8")
}
"""The dtypes written as they arrive: their serialized bytes are the tensor's, value for value."""
MAX_BYTES = 2**40
"""The largest tensor a donor may declare (1 TiB): a larger size is refused before anything is
allocated (the pages of a smaller one are taken only as its bytes arrive)."""


class Incoming:
    """One tensor of a state being downloaded, from its ``first`` part on."""

    def __init__(self, first: runtime_pb2.Tensor) -> None:
        if not first.dtype:
            raise ValueError("a state's tensor began without its dtype")
        plain = first.compression == runtime_pb2.CompressionType.NONE
        dtype = DIRECT.get(first.dtype) if plain else None
        self._parts: list[runtime_pb2.Tensor] | None = None if dtype is not None else [first]
        self._grad = first.requires_grad
        self._at = 0
        if dtype is not None:
            shape = tuple(first.size)
            size = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
            if size > MAX_BYTES:
                raise ValueError(f"a state's tensor declares shape {shape} of {first.dtype}")
            self._tensor = torch.empty(shape, dtype=dtype).share_memory_()
            self._bytes = self._tensor.view(-1).view(torch.uint8).numpy()
            self.add(first)

    def add(self, part: runtime_pb2.Tensor) -> None:
        """The tensor's next part."""
        if self._parts is not None:
            self._parts.append(part)
            return
        end = self._at + len(part.buffer)
        if end > len(self._bytes):
            raise ValueError(f"a state's tensor sent more than its {len(self._bytes)} bytes")
        self._bytes[self._at : end] = np.frombuffer(part.buffer, dtype=np.uint8)
        self._at = end

    def done(self) -> torch.Tensor:
        """The whole tensor, once its last part came (``ValueError`` if it was cut short)."""
        if self._parts is not None:
            return deserialize_torch_tensor(combine_from_streaming(self._parts))
        if self._at != len(self._bytes):
            raise ValueError(f"a state's tensor sent {self._at} of its {len(self._bytes)} bytes")
        return self._tensor.requires_grad_(self._grad)

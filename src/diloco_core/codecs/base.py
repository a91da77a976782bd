"""The ``Codec`` interface: how fp32 values travel on the wire, and how received payloads are averaged back.

A transport moves payloads and never encodes or decodes values itself: it asks the codec for the
payload's shape (``payload_spec``), has every contribution encoded (``encode``), and averages what it
received with ``Codec.mean_of``, which decodes each payload into fp32. Cast codecs (fp32, fp16, bf16:
``cast``) cast element by element; block codecs (int8, int4: ``block``; sign: ``sign``) quantize blocks of
values with one scale each. Peers average together only when their codecs' ``identity`` is equal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Codec", "CodecId"]


@dataclass(frozen=True)
class CodecId:
    """What peers must share to average together: the codec, its values per scale and its payload layout.
    The settings check, the torch transport's reduce header and hivemind's averager names all compare it."""

    name: str
    block: int
    layout: int

    def __str__(self) -> str:
        """The one spelling of the identity where a string is needed (names on the wire, messages):
        ``fp16``, ``int8b256``, ``int4b256v2`` (the block where it has one, the layout where it is not 1)."""
        block = f"b{self.block}" if self.block != 1 else ""
        return self.name + block + (f"v{self.layout}" if self.layout != 1 else "")


class Codec(ABC):
    """Encodes a flat fp32 tensor of ``numel`` values into a payload tensor of ``payload_spec(numel)``."""

    name: str
    """The codec's name in config (``[diloco] codec``) and in error messages."""

    elementwise_dtype: torch.dtype | None = None
    """The dtype each value is cast to when the payload is the values themselves, element by element
    (then a slice of a payload is the payload of that slice, and a backend that sums fp32 natively may
    sum an fp32 payload itself). None for codecs whose payload is not one value per element."""

    layout: int = 1
    """Version of the payload's layout (int4: 2 since its codes travel as two's complement nibbles; sign: 2
    since its bits travel as bit planes): peers whose layouts differ never average together (``DiLoCo``'s
    settings check, hivemind's group names)."""

    block: int = 1
    """Values encoded together. The payload of a slice that starts at a multiple of ``block`` decodes to
    that slice of the whole's decoded values, so a transport that encodes chunks on their own cuts
    there: every peer then decodes exactly what the contributor's own ``decode(encode(x))`` gives."""

    @abstractmethod
    def payload_spec(self, numel: int) -> tuple[int, torch.dtype]:
        """(number of elements, dtype) of the payload for ``numel`` values."""

    @abstractmethod
    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload of the flat fp32 ``values`` (written into ``out`` if given). May return ``values``
        itself when the payload is the values (fp32): the caller must not change them meanwhile."""

    @abstractmethod
    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """``into += decode(payload)`` in fp32; ``scratch`` (fp32, ``into``'s shape) is reused if given."""

    @abstractmethod
    def mean_of(
        self, payloads: Sequence[torch.Tensor], out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``out`` = the fp32 mean of the decoded ``payloads``, summed in their order, then divided: the wire
        contract (``reference_mean`` writes it plainly). ``scratch`` (fp32, ``out``'s shape) is reused if
        given: allocating a large fresh buffer costs more than the arithmetic (page faults)."""

    @property
    def identity(self) -> CodecId:
        """What a peer must share with this codec to average with it."""
        return CodecId(self.name, self.block, self.layout)

    def pad(self, flat: torch.Tensor, numel: int) -> None:
        """Fill ``flat[numel:]`` up to the end of the block of value ``numel - 1`` (the padding a buffer puts
        after ``numel`` values, so that what follows starts a block), so that the block encodes as its own
        values would alone: zeros here (an absmax ignores them)."""
        flat[numel : -(-numel // self.block) * self.block].zero_()

    def with_block(self, block: int) -> Codec:
        """This codec with ``block`` values per scale (itself where values are not encoded in blocks)."""
        return self

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = decode(payload)`` in fp32."""
        out.zero_()
        self.add_decoded(payload, out)
        return out

    def prepare(self, like: torch.Tensor, *, payloads: Sequence[int] = (2,)) -> None:
        """Get ready to encode, decode, and average ``payloads`` payloads of up to ``like.numel()`` values on
        ``like``'s device (block codecs compile their fused kernels: seconds a round should not spend)."""

    def payload_bytes(self, numel: int) -> int:
        n, dtype = self.payload_spec(numel)
        return n * dtype.itemsize

    def check(self, payload: torch.Tensor, numel: int) -> None:
        """Raise ``ValueError`` unless ``payload`` (received from a peer) is a valid payload of ``numel``
        values: its shape and dtype, and finite values where they are floats."""
        n, dtype = self.payload_spec(numel)
        if payload.dtype != dtype or payload.shape != (n,):
            raise ValueError(
                f"{self.name} payload of {numel} values must be {n} x {dtype}, got {tuple(payload.shape)} x {payload.dtype}"
            )
        if payload.is_floating_point() and not bool(torch.isfinite(payload).all()):
            raise ValueError(f"{self.name} payload holds NaN or infinite values")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

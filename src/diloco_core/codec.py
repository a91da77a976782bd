"""Codecs: how fp32 values travel on the wire, and how received payloads are summed back in fp32.

A transport moves payloads and never encodes or decodes values itself: it asks the codec for the
payload's shape (``payload_spec``), has every contribution encoded (``encode``), and sums what it
received with ``diloco_core.wire.mean_of_payloads``, which decodes each payload into fp32
(``add_decoded``). The first codecs cast element by element (fp32, fp16, bf16); a compressing codec
(int8 with a scale per block, later) implements the same four methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["BF16", "CODECS", "FP16", "FP32", "CastCodec", "Codec", "check_codec", "codec_for"]


class Codec(ABC):
    """Encodes a flat fp32 tensor of ``numel`` values into a payload tensor of ``payload_spec(numel)``."""

    name: str
    """The codec's name in config (``[diloco] wire_dtype``) and in error messages."""

    elementwise_dtype: torch.dtype | None = None
    """The dtype each value is cast to when the payload is the values themselves, element by element
    (then a slice of a payload is the payload of that slice, and a backend that sums fp32 natively may
    sum an fp32 payload itself). None for codecs whose payload is not one value per element."""

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

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = decode(payload)`` in fp32."""
        out.zero_()
        self.add_decoded(payload, out)
        return out

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


class CastCodec(Codec):
    """Each value cast to ``dtype`` (round to nearest); decoded by widening back to fp32."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.elementwise_dtype = dtype

    def payload_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return numel, self.elementwise_dtype

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:
            return out.copy_(values)
        return values if values.dtype == self.elementwise_dtype else values.to(self.elementwise_dtype)

    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        if payload.dtype != torch.float32:  # a widening copy, then an fp32 add: far faster than a mixed-dtype add
            payload = (torch.empty_like(into) if scratch is None else scratch).copy_(payload)
        into.add_(payload)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(payload)


FP32 = CastCodec("fp32", torch.float32)
FP16 = CastCodec("fp16", torch.float16)
BF16 = CastCodec("bf16", torch.bfloat16)

CODECS: dict[str, Codec] = {c.name: c for c in (FP32, FP16, BF16)}
"""The codecs config can name."""


def codec_for(name: str | Codec) -> Codec:
    """The codec called ``name`` (a ``Codec`` is returned as is)."""
    if isinstance(name, Codec):
        return name
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"wire_dtype={name!r} is invalid: expected one of {sorted(CODECS)}") from None


def check_codec(codec: object) -> Codec:
    """``codec`` if it is a ``Codec``; a clear ``ValueError`` otherwise (a transport's input check)."""
    if not isinstance(codec, Codec):
        raise ValueError(
            f"codec={codec!r} is invalid: expected a Codec, e.g. codec_for(name) with a name in {sorted(CODECS)}"
        )
    return codec

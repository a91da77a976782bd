"""The ``Codec`` interface: how fp32 values travel on the wire, and how received payloads are averaged back.

A transport moves payloads and never encodes or decodes values itself: it asks the codec for the payload's
shape (``payload_spec``), has every contribution encoded (``encode``) and averages what it received with
``mean_of``. Peers average together only when their codecs' ``identity`` is equal. Here too: the casts
(fp32, fp16, bf16), each value cast to a float dtype, averaged in fp32."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["BF16", "FP16", "FP32", "CastCodec", "Codec", "CodecId"]


@dataclass(frozen=True)
class CodecId:
    """What peers must share to average together: the codec, its values per scale, its payload layout.
    The settings check, the torch reduce header and hivemind's averager names compare it; ``str`` is its one
    spelling where a string is needed: ``fp16``, ``int8b256``, ``int4b256v2`` (a block and layout not 1),
    ``topk2k4b256`` (a ``variant``)."""

    name: str
    block: int
    layout: int
    variant: str = ""
    """What else its peers must share, after the name (topk: its value bits and values kept per block)."""

    def __str__(self) -> str:
        block = f"b{self.block}" if self.block != 1 else ""
        return self.name + self.variant + block + (f"v{self.layout}" if self.layout != 1 else "")


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
    since its bits travel as bit planes), part of the ``identity``."""

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
        """Fill the padding after ``numel`` values up to the end of their last block so that the block encodes
        as its own values alone would: zeros here (an absmax ignores them)."""
        flat[numel : -(-numel // self.block) * self.block].zero_()

    def with_block(self, block: int) -> Codec:
        """This codec with ``block`` values per scale (itself where values are not encoded in blocks)."""
        return self

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = decode(payload)`` in fp32: the mean of one payload (its values divided by 1: exact)."""
        return self.mean_of([payload], out)

    def pieces(self, payloads: Sequence[torch.Tensor], numel: int, *, span: range, size: int) -> Iterator[torch.Tensor]:
        """The decoded values ``span`` (from a block's start) of ``payloads`` (of ``numel`` values each), a piece at
        a time: one (payloads, about ``size``) fp32 tensor per consecutive slice, valid until the next is asked for,
        so a judge of contributions reads them in cache-sized pieces, never decoded whole. Here, for codecs whose
        payload is the values cast; the others (block codecs) decode a piece of each payload on its own."""
        assert self.elementwise_dtype is not None, f"{self.name} must say how its payloads decode piece by piece"
        for i in range(span.start, span.stop, size):
            yield torch.stack([p[i : min(span.stop, i + size)] for p in payloads]).float()

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


class CastCodec(Codec):
    """Each value cast to ``dtype`` (round to nearest); decoded by widening back to fp32."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.elementwise_dtype = dtype

    def payload_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return numel, self.elementwise_dtype

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        dtype = self.elementwise_dtype
        if dtype == torch.float32:
            return values if out is None else out.copy_(values)
        flat = values.reshape(-1)
        out = torch.empty(flat.numel(), dtype=dtype, device=flat.device) if out is None else out
        peaks = []  # chunk by chunk: the max |x| read while the chunk is still in cache
        for src, dst in zip(flat.split(2**18), out.view(-1).split(2**18)):
            if src.numel():  # an empty tensor splits into one empty chunk, which has no max
                dst.copy_(src)
                peaks.append(torch.maximum(src.amax(), src.amin().neg()))  # max |x|, NaN if any, no abs() temporary
        # fp16 turns |x| >= 65520 into inf: the largest magnitude, cast alone, rounds as every value did
        if peaks and not bool(torch.stack(peaks).amax().to(dtype).isfinite()):
            raise ValueError(
                f"{self.name} cannot encode NaN, infinite or out-of-range values (|x| > {torch.finfo(dtype).max:g})"
            )
        return out

    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        """``into += decode(payload)`` in fp32; ``scratch`` (fp32, ``into``'s shape) is reused if given."""
        if payload.dtype != torch.float32:  # a widening copy, then an fp32 add: far faster than a mixed-dtype add
            payload = (torch.empty_like(into) if scratch is None else scratch).copy_(payload)
        into.add_(payload)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(payload)

    def mean_of(
        self, payloads: Sequence[torch.Tensor], out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert payloads, "a mean needs at least one contribution"
        fp32 = self.elementwise_dtype == torch.float32
        if len(payloads) > 1 and fp32:
            torch.add(payloads[0], payloads[1], out=out)  # one pass for the first two addends
            rest = payloads[2:]
        else:
            self.decode(payloads[0], out)
            rest = payloads[1:]
        if rest and scratch is None and not fp32:
            scratch = torch.empty_like(out)
        for p in rest:
            self.add_decoded(p, out, scratch)
        return out.div_(len(payloads))


FP32 = CastCodec("fp32", torch.float32)
FP16 = CastCodec("fp16", torch.float16)
BF16 = CastCodec("bf16", torch.bfloat16)

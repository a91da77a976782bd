"""Cast codecs: each value cast to a float dtype (fp32, fp16, bf16), averaged in fp32."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec

__all__ = ["BF16", "FP16", "FP32", "CastCodec"]


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

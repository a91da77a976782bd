"""Error feedback: what a lossy codec drops of a worker's pseudo-gradient is added to its next one."""

from __future__ import annotations

import torch

from .codecs.base import Codec

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """One worker's residual e: it sends Δ + e, and e becomes (Δ + e) - decode(encode(Δ + e)), exactly
    what its peers lose of its contribution (the codec is deterministic and transports cut payloads only
    at multiples of ``codec.block``). So the updates applied sum to the pseudo-gradients' sum minus the
    last residual, which stays bounded (int8/int4: half a step per value; sign: per block s/(1-s) times the
    largest block norm fed, s = sqrt(1 - 1/block)). Only the first ``fed`` values are fed; the rest of
    their last block is padding (``Codec.pad``), then diagnostics. One encode and decode per round besides
    the transport's, and two fp32 buffers: the next residual waits until the reduce succeeded (``commit``),
    so a retried round feeds the same e again. In ``DiLoCo.state_dict()``, not ``RunState``: joiners start at 0.
    Off (does nothing, holds nothing) unless ``on`` and the codec is lossy (not fp32).
    """

    def __init__(self, codec: Codec, flat: torch.Tensor, *, fed: int, on: bool) -> None:
        self.codec, self.fed, self.on = codec, fed, on and codec.elementwise_dtype != torch.float32
        like = flat if self.on else flat[:0]
        self._kept, self._next = torch.zeros_like(like), torch.zeros_like(like)
        size, dtype = codec.payload_spec(like.numel())
        self._payload = torch.empty(size, dtype=dtype, device=flat.device)

    @property
    def residual(self) -> torch.Tensor | None:
        """What the codec dropped and no round has sent since (one value per fed value); None when off."""
        return self._kept[: self.fed] if self.on else None

    def feed(self, flat: torch.Tensor) -> None:
        """Add the residual to ``flat`` before a transport encodes it; compute the residual it leaves."""
        if self.on:
            flat[: self.fed].add_(self._kept[: self.fed])
            self.codec.pad(flat, self.fed)  # for the values now in its last block
            self.codec.decode(self.codec.encode(flat, out=self._payload), self._next)
            torch.sub(flat, self._next, out=self._next)

    def commit(self) -> None:
        """The reduce of what was fed last succeeded: its residual is the one to feed next."""
        self._kept, self._next = self._next, self._kept

    def load(self, residual: torch.Tensor | None) -> None:
        """Set the residual from ``DiLoCo.state_dict()``; None (saved without error feedback): zero."""
        if self.on:
            if residual is not None and residual.shape != (self.fed,):
                raise ValueError(f"the saved error-feedback residual has {residual.numel()} values, not {self.fed}")
            self._kept[: self.fed].copy_(torch.zeros(()) if residual is None else residual)

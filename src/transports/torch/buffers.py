"""The scratch buffers of the torch transport's reduces."""

from __future__ import annotations

import torch

__all__ = ["Buffers"]


class Buffers:
    """Scratch buffers of one reduce key, kept from round to round: a fresh 100 MB buffer costs more in
    page faults than the arithmetic done in it. A second reduce of the same key while the first is in
    flight gets fresh ones."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.busy = False
        self._cache: dict[tuple, torch.Tensor] = {}

    def release(self) -> None:
        """The reduce that used them is over: the key's next reduce may take them."""
        self.busy = False

    def get(self, name: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._cache.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._cache[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf

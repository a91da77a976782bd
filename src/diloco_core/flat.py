"""One contiguous fp32 buffer with a view per parameter, so that round math runs as a few big ops."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FlatBuffer"]


class FlatBuffer:
    def __init__(self, like: Sequence[torch.Tensor], device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        self.shapes = [tuple(t.shape) for t in like]
        numels = [t.numel() for t in like]
        self.flat = torch.zeros(sum(numels), dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for shape, n in zip(self.shapes, numels):
            self.views.append(self.flat[offset : offset + n].view(shape))
            offset += n

    def copy_from(self, tensors: Sequence[torch.Tensor]) -> None:
        tensors = list(tensors)
        if all(t.dtype == self.flat.dtype and t.device == self.flat.device for t in tensors):
            torch.cat([t.detach().reshape(-1) for t in tensors], out=self.flat)  # one pass, one kernel
        else:
            torch._foreach_copy_(self.views, tensors)

    def copy_to(self, tensors: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(list(tensors), self.views)

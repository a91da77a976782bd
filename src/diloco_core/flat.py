"""One contiguous fp32 buffer with a view per parameter, so that round math runs as a few big ops."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FlatBuffer", "local_of", "norm_of", "placement_of"]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (sharing its storage; FSDP2), else ``t``.
    Duck-typed, as the core never imports torch.distributed; the round math runs on local tensors only."""
    return t.to_local().detach() if hasattr(t, "to_local") else t


def placement_of(t: torch.Tensor) -> str:
    """Which shard of a DTensor this rank holds ("" for a plain tensor), so that ranks holding different
    shards fail ``ModelState.check_same`` instead of averaging unrelated values."""
    return f", shard {t.device_mesh.get_coordinate()} of {tuple(t.placements)}" if hasattr(t, "to_local") else ""


def norm_of(t: torch.Tensor) -> float:
    """The L2 norm of fp32 ``t``; summed in fp64 where the fp32 sum of squares overflows (values past ~1e19)."""
    norm = torch.linalg.vector_norm(t).item()
    return norm if norm < float("inf") else torch.linalg.vector_norm(t, dtype=torch.float64).item()


class FlatBuffer:
    """``body`` holds the tensors' values back to back in fp32 (``views`` are its per-tensor views); ``extra``
    more values follow it in ``flat``, so that a few scalars can travel in the same collective as the body
    without a concatenating copy."""

    def __init__(self, like: Sequence[torch.Tensor], device: torch.device | str, extra: int = 0) -> None:
        numels = [t.numel() for t in like]
        self.flat = torch.zeros(sum(numels) + extra, dtype=torch.float32, device=device)
        self.body = self.flat[: sum(numels)]
        self.views: list[torch.Tensor] = []
        offset = 0
        for t, n in zip(like, numels):
            self.views.append(self.flat[offset : offset + n].view(t.shape))
            offset += n

    def copy_from(self, tensors: Sequence[torch.Tensor]) -> None:
        tensors = list(tensors)
        if all(t.dtype == self.flat.dtype and t.device == self.flat.device for t in tensors):
            torch.cat([t.detach().reshape(-1) for t in tensors], out=self.body)  # one pass, one kernel
        else:
            torch._foreach_copy_(self.views, tensors)

    def copy_to(self, tensors: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(list(tensors), self.views)

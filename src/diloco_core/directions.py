"""Radial-directional averaging (RDA, Decoupled DiLoCo, arXiv 2604.21428; ``DiLoCoConfig.rda``): per tensor t,
merged_t = (Σ w_i ||Δ_i,t|| / Σ w_i) · unit(Σ w_i unit(Δ_i,t)), the workers' mean norm along their mean direction:
it keeps their step length as M grows, where the plain mean of M partly disagreeing ones shrinks towards 1/√M.
A worker sends each tensor's unit direction in its place, then each norm as a run of whole codec blocks of that one
value (block codecs carry it to fp32 rounding, where a block shared with other values would wreck it; casts round
it as any value), in the round's own reduce: the guard's work weights and rescale give both weighted means, and
every worker joins them from the same reduced values: the same step on all, no state. The robust merge judges the
norms apart from the directions (``Merge.apart``: distances of another scale); a run is read at its value
``MIN_JUDGED``, which a transport's part that cuts fewer than ``MIN_JUDGED`` values off the runs (unjudged) misses.
"""

from __future__ import annotations

import torch

from .codecs.base import Codec
from .flat import FlatBuffer
from .merge import MIN_JUDGED

__all__ = ["Directions", "sent_size"]


def sent_size(numel: int, *, tensors: int, block: int) -> int:
    """Values sent for ``tensors`` tensors of ``numel`` values in all (codec ``block``): their directions, zeros up
    to a block, then a run per tensor of its norm, whole blocks and at least 2 ``MIN_JUDGED`` values."""
    return numel + (-numel % block) + tensors * max(block, 2 * MIN_JUDGED)


class Directions:
    """RDA on a fragment's reduce buffer ``[directions | pad | norm runs | guard tail]`` (``reduce``: one view
    per tensor)."""

    def __init__(self, reduce: FlatBuffer, codec: Codec) -> None:
        self.views, self.flat, self.codec, self.numel = reduce.views, reduce.flat, codec, reduce.body.numel()
        self.at = at = sent_size(self.numel, tensors=0, block=codec.block)
        """Where the norm runs begin (the robust merge judges the values before it apart from them)."""
        self.norms = self.flat[at : sent_size(at, tensors=len(self.views), block=codec.block)].view(len(self.views), -1)

    def split(self) -> None:
        """Before sending: each tensor becomes its unit direction (zeros stay zeros), its norm fills its run."""
        norms = torch.stack(torch._foreach_norm(self.views))
        torch._foreach_mul_(self.views, torch.where(norms > 0, 1 / norms, 0).tolist())
        self.codec.pad(self.flat, self.numel)  # the last reduce left its decoded values there
        self.norms.copy_(norms[:, None])

    def join(self) -> None:
        """After the reduce (rescaled by the guard): each tensor becomes the mean norm (never below 0: an insider's
        cannot flip the step) along its mean direction (zeros where the directions cancel, or none was valid)."""
        lengths = torch.stack(torch._foreach_norm(self.views))
        norms = self.norms[:, MIN_JUDGED].clamp(min=0)
        torch._foreach_mul_(self.views, torch.where(lengths > 0, norms / lengths, 0).tolist())

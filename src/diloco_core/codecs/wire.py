"""The reference mean every transport must reproduce bit for bit.

Contract: each contribution travels as its codec's payload; the receiver decodes every payload into
fp32, sums them in rank order, and divides by the number of contributors. Every participant ends
with the same fp32 result, so replicas never drift apart through rounding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec
from .names import codec_for

__all__ = ["reference_mean"]


def reference_mean(
    contributions: Sequence[torch.Tensor],
    codec: Codec | str,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 mean of the fp32 ``contributions`` after each went through ``codec``, summed in the given
    order: what every transport's all-reduce must produce. ``codec``: a ``Codec`` or its name."""
    assert contributions, "a mean needs at least one contribution"
    codec = codec_for(codec)
    payloads = [codec.encode(c.reshape(-1)) for c in contributions]
    first = contributions[0]
    total = torch.empty(first.numel(), dtype=torch.float32, device=first.device) if out is None else out.view(-1)
    # The definition, written plainly (not ``Codec.mean_of``, whose fused paths it checks): decode each
    # payload, sum in order, divide.
    decoded = torch.empty_like(total) if scratch is None else scratch.view(-1)
    codec.decode(payloads[0], total)
    for p in payloads[1:]:
        total.add_(codec.decode(p, decoded))
    return total.div_(len(payloads)).view(first.shape)

"""Wire dtypes and the reference mean every transport must reproduce bit for bit.

Contract: each contribution travels as ``wire_dtype``; the receiver widens to fp32, sums the
contributions in rank order, and divides by the number of contributors. Every participant ends with
the same fp32 result, so replicas never drift apart through rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["WIRE_DTYPES", "wire_torch_dtype", "reference_mean"]

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def wire_torch_dtype(wire_dtype: str) -> torch.dtype:
    try:
        return WIRE_DTYPES[wire_dtype]
    except KeyError:
        raise ValueError(f"wire_dtype={wire_dtype!r} is invalid: expected one of {sorted(WIRE_DTYPES)}") from None


def reference_mean(contributions: Sequence[torch.Tensor], wire_dtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 mean of the contributions after each was cast to ``wire_dtype`` (summed in the given order)."""
    assert contributions, "a mean needs at least one contribution"
    dtype = wire_torch_dtype(wire_dtype)
    total = torch.zeros_like(contributions[0], dtype=torch.float32) if out is None else out
    total.copy_(contributions[0].to(dtype))
    for c in contributions[1:]:
        total.add_(c if c.dtype == dtype else c.to(dtype))
    return total.div_(len(contributions))

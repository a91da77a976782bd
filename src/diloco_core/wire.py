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


def reference_mean(
    contributions: Sequence[torch.Tensor],
    wire_dtype: str,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 mean of the contributions after each was cast to ``wire_dtype``, summed in the given order.

    ``out`` and ``scratch`` (fp32, the contributions' shape) are reused if given: allocating a large
    fresh buffer costs more than the arithmetic (page faults).
    """
    assert contributions, "a mean needs at least one contribution"
    dtype = wire_torch_dtype(wire_dtype)
    wire = [c if c.dtype == dtype else c.to(dtype) for c in contributions]
    total = torch.empty_like(contributions[0], dtype=torch.float32) if out is None else out
    if len(wire) > 1 and dtype == torch.float32:
        torch.add(wire[0], wire[1], out=total)  # one pass for the first two addends
        rest = wire[2:]
    else:
        total.copy_(wire[0])
        rest = wire[1:]
    if rest and dtype != torch.float32 and scratch is None:
        scratch = torch.empty_like(total)
    for w in rest:
        if dtype != torch.float32:  # widening copy, then an fp32 add: far faster than a mixed-dtype add
            w = scratch.copy_(w)
        total.add_(w)
    return total.div_(len(wire))

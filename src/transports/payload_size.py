"""A payload's size follows from its codec, the codec's settings and the reduce's values
(``Codec.payload_spec``): a contribution of another size is refused and its sender named (issue 46:
a swarm once shipped payloads 5.5x their declared size by flipping a codec flag its identity did not
carry). In-process (``inprocess_group``) and hivemind (``hivemind.checks``) measure each payload they
receive; torch cannot (gloo aborts the receiving process on a longer one and leaves a shorter one's
missing tail stale), so every rank states the bytes its codec sends in the reduce's header and the
ranks compare them before any payload moves (``torch.identity``)."""

from __future__ import annotations

import torch

from diloco_core import Codec

__all__ = ["misfit"]


def misfit(payload: torch.Tensor, *, codec: Codec, numel: int) -> str | None:
    """Why ``payload`` is not ``codec``'s payload of ``numel`` values by its size or dtype: the bytes
    received and the bytes expected. None where it is one (its values are ``Codec.check``'s)."""
    n, dtype = codec.payload_spec(numel)
    if payload.dtype == dtype and tuple(payload.shape) == (n,):
        return None
    got = payload.numel() * payload.element_size()
    return (
        f"{got} bytes ({payload.dtype}{list(payload.shape)}), expected {n * dtype.itemsize} "
        f"({dtype}[{n}]: {codec.identity} of {numel} values)"
    )

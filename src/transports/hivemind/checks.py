"""Checks on what peers send: nothing received is used before its shape, dtype and values are checked."""

from collections.abc import Sequence
from typing import Any

import torch

from diloco_core import Codec

from ..payload_size import misfit
from .state_tag import valid_tag


def all_finite(t: torch.Tensor) -> bool:
    """One pass, no temporary: min and max are NaN if any value is, and +-inf if any value is."""
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


def checked(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` if all its values are finite (run in hivemind's executor threads, off the event loop)."""
    if t.is_floating_point() and t.numel() and not all_finite(t):
        raise ValueError(f"{what}: holds non-finite values")
    return t


def check_tensor(
    t: torch.Tensor, *, shape: Sequence[int], dtype: torch.dtype, what: str, finite: bool = True
) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``t`` has ``shape`` and ``dtype`` (and finite values)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{what}: got {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
    if finite:
        checked(t, what)


def check_payload(t: torch.Tensor, *, codec: Codec, numel: int, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``t`` is ``codec``'s payload of ``numel`` values:
    its size and dtype (``payload_size``: the bytes received and expected), then ``codec.check``."""
    wrong = misfit(t, codec=codec, numel=numel)
    if wrong is not None:
        raise ValueError(f"{what}: {wrong}")
    codec.check(t, numel)


def valid_state(meta: Any, tensors: Any) -> bool:
    """Whether a state a peer served (``StateServer``) is whole and well-formed: never use part of one."""
    if not isinstance(meta, dict) or meta.get("ready") is not True:
        return False
    counts, extra = meta.get("broadcasts"), meta.get("extra")
    if not isinstance(counts, list) or not all(isinstance(c, int) and c >= 0 for c in counts):
        return False
    if not isinstance(extra, dict):
        return False
    if any(meta.get(k) is not None and not valid_tag(meta[k]) for k in ("tag", "prev_tag")):
        return False
    # A download cut short can arrive with fewer tensors than were served: never use part of a state.
    if (
        not isinstance(tensors, list)
        or len(tensors) < sum(counts)
        or len(tensors) != meta.get("num_tensors")
    ):
        return False
    return all(
        isinstance(t, torch.Tensor)
        and (not t.is_floating_point() or not t.numel() or all_finite(t))
        for t in tensors
    )

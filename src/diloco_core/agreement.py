"""What every worker must agree on, checked once when ``DiLoCo`` is built: rank 0's value on every rank.

Different settings between workers trained silently apart before (different ``outer_lr``: different
replicas; different ``inner_steps``: rounds of different indices paired; a different wire: a hang until
the timeout, blamed on a dead peer). Now each rank compares its settings with rank 0's and, where ranks
are fixed, learns from one small reduce whether any rank differs, so every rank fails with the same
clear ``ValueError``. On a transport whose peers come and go, rank 0 is whoever holds the run's state,
and a joiner that differs refuses itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from .codecs.base import FP32, Codec
from .config import DiLoCoConfig
from .fragment import Fragment
from .transport import Transport

__all__ = ["check_settings", "differs_anywhere", "rank0s", "settings_of"]


def rank0s(transport: Transport, value: Any, *, timeout: float, device: torch.device) -> Any:
    """Rank 0's ``value`` (JSON-able) on every rank: two broadcasts, its size then its bytes."""
    mine = json.dumps(value).encode()
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    transport.broadcast([size], src=0, timeout=timeout)
    theirs = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if len(mine) == theirs.numel():  # on rank 0; elsewhere the broadcast overwrites it
        theirs.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    transport.broadcast([theirs], src=0, timeout=timeout)
    return json.loads(bytes(theirs.tolist()))


def differs_anywhere(transport: Transport, flags: torch.Tensor, timeout: float) -> torch.Tensor:
    """``flags`` summed over the ranks where ranks are fixed (each rank's 1s say where it differs from rank
    0), else this rank's own: peers that come and go each check themselves."""
    if transport.capabilities.fixed_ranks:
        flags.mul_(transport.all_reduce([flags], codec=FP32, key="diloco/check").wait(timeout).num_contributors)
    return flags


def check_settings(transport: Transport, settings: dict[str, Any], *, timeout: float, device: torch.device) -> None:
    """Refuse, on every rank, a group in which a rank's ``settings`` differ from rank 0's (collective)."""
    rank0 = rank0s(transport, settings, timeout=timeout, device=device)
    keys = sorted(set(settings) | set(rank0))
    mine = [settings.get(k) != rank0.get(k) for k in keys]
    flags = differs_anywhere(transport, torch.tensor(mine, dtype=torch.float32, device=device), timeout)
    if any(mine):
        diff = ", ".join(f"{k}={settings.get(k)!r} here vs {rank0.get(k)!r} on rank 0" for k, d in zip(keys, mine) if d)
        raise ValueError(
            f"rank {transport.rank}'s DiLoCo settings differ from rank 0's: {diff}; every worker must use the same"
        )
    if bool((flags > 0).any()):
        named = [f"{k}={rank0.get(k)!r}" for k, f in zip(keys, flags.tolist()) if f > 0]
        raise ValueError(
            f"another rank's DiLoCo settings differ from rank 0's in {', '.join(named)} (rank 0's values); "
            "every worker must use the same"
        )


def settings_of(c: DiLoCoConfig, *, codec: Codec, outer_lr: float, fragments: Sequence[Fragment]) -> dict[str, Any]:
    """What every worker must agree on: the round's schedule, the outer step (``outer_lr`` as used), how
    pseudo-gradients travel (``codec``, error feedback as used), the guard and the overlap (``fragments``)."""
    return {
        "inner_steps": c.inner_steps,
        "round_seconds": c.round_seconds,
        "outer_lr": outer_lr,
        "outer_momentum": c.outer_momentum,
        "nesterov": c.nesterov,
        "codec": str(codec.identity),  # its name, block and payload layout
        "error_feedback": fragments[0].feedback.on,
        "norm_clip": c.norm_clip,
        "merge": c.merge,
        "outlier_ratio": c.outlier_ratio,
        "rda": c.rda,
        "overlap": c.overlap,
        "fragments": len(fragments),
        "overlap_steps": c.overlap_steps,
        "merge_alpha": c.merge_alpha,
        "eager_fresh_weight": c.eager_fresh_weight,
    }

"""One invocation of the trainer as its workers share it: the config, data and run folder, how they stop
and what they hand back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco_core import Transport

from .data.corpus import Corpus
from .outcome import Outcome
from .run_config import RunConfig
from .stops import Stops

__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    """One invocation, as its workers (threads of this process, or just one) share it: what they read, never
    changed, and the two owners of what they change together (``stops``, ``outcome``)."""

    config: RunConfig
    corpus: Corpus
    run_dir: Path
    resume: bool
    same_disk: bool = False
    """Every worker's checkpoints are in this process's run folder (in-process workers): saved once there."""
    secret_keys: frozenset[str] = frozenset()
    """Keys of [transport] never written to config.toml."""
    islands: Callable[[torch.nn.Module, Any], Transport] | None = None
    """train.fsdp_shards > 1: the transport between the islands for a model sharded over a mesh
    (``TransportSpec.connect_islands``); DiLoCo averages over it, the trainer's own agreements over the world."""
    stops: Stops = field(default_factory=Stops)
    """How the workers stop together: a failing worker or a signal."""
    outcome: Outcome = field(default_factory=Outcome)
    """What the workers hand back: errors, rank 0's reporter and result, busy seconds."""

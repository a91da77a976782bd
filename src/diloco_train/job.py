"""One invocation of the trainer as its workers share it: the config, data and run folder, and the stop that
a failing worker or a signal sets."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco_core import Transport

from .data.corpus import Corpus
from .report.metrics import Reporter, TrainResult
from .run_config import RunConfig

__all__ = ["Job"]


@dataclass
class Job:
    """One invocation, as its workers (threads of this process, or just one) share it."""

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
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when a worker thread fails or the run is interrupted: the others leave their loop."""
    errors: list[BaseException] = field(default_factory=list)
    """What the worker threads raised, for the launching thread to re-raise."""
    reporter: Reporter | None = None
    """Rank 0's, once it has started (the launcher closes it)."""
    busy: dict[int, float] = field(default_factory=dict)
    """Each worker's busy seconds so far (``Pace``), for rank 0's goodput when every worker is in this process."""
    result: TrainResult | None = None
    """Rank 0's, once it has finished."""
    warned_nonfinite: bool = False
    """A worker has said that a state of its was not finite, so not checkpointed (said once per process)."""
    interrupted: bool = False
    """A signal asked the run to stop: its workers stop at one step (``stop_at``), checkpoint it and leave."""
    stop_at: int | None = None
    begun: dict[int, int] = field(default_factory=dict)
    """Each worker's step once it has begun it (the one it will reach), for ``stop_at``."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request_stop(self) -> bool:
        """From the signal handler: every worker of this process stops at the same step (``stop_here``) and
        checkpoints it. False where no worker has begun a step: nothing new to checkpoint, stop at once."""
        with self.lock:
            self.interrupted = bool(self.begun)
            return self.interrupted

    def stop_here(self, rank: int, step: int) -> bool:
        """Whether ``rank``, about to begin the step after ``step``, stops instead. Once interrupted, the workers
        stop at the furthest step one of them has begun (they may be a round apart), so each stops at that one
        step and checkpoints it; none begins a step past it."""
        with self.lock:
            if self.interrupted and self.stop_at is None:
                self.stop_at = max(self.begun.values(), default=step)
            if self.stop_at is not None and step >= self.stop_at:
                return True
            self.begun[rank] = step + 1
            return False

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()

"""A run that diverges: non-finite losses counted step by step, and states that are not finite.

One NaN or infinite loss makes the gradients, then the weights and optimizer moments, non-finite: nothing
trains on from there. The worker stops with an error after ``train.max_nonfinite_losses`` such losses in a
row, and never checkpoints a state that is not finite, so the good checkpoints before it stay on disk. A
finite loss spike (``spikes.py``) does not stop the run; the newest checkpoint from before it is kept out of
rotation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diloco_core.flat import local_of

from .rank_files import RankFiles
from .spikes import SpikeWatch

__all__ = ["LossWatch", "all_finite"]

_CHUNK = 1 << 24
"""Values checked at a time: ``isfinite`` of a whole 1B-value tensor would allocate 1 GB of booleans."""


def all_finite(obj: Any) -> bool:
    """Whether every floating-point tensor in ``obj`` (tensors, dicts, lists and tuples of them) is finite."""
    if isinstance(obj, torch.Tensor):
        # a DTensor (FSDP2) as its local shard: a collective here could deadlock
        obj = local_of(obj)
        if not obj.is_floating_point():
            return True
        flat = obj.detach().reshape(-1)
        return all(
            bool(torch.isfinite(flat[i : i + _CHUNK]).all()) for i in range(0, flat.numel(), _CHUNK)
        )
    if isinstance(obj, dict):
        return all(all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(all_finite(v) for v in obj)
    return True


class LossWatch:
    """Counts one worker's non-finite losses in a row; the ``limit``-th ends the run with a ValueError. Its
    finite losses go to a ``SpikeWatch``, which keeps the checkpoint from before a spike out of rotation."""

    def __init__(self, *, limit: int, files: RankFiles, lr: float) -> None:
        self.limit = limit
        self.files = files
        self.lr = lr
        self.spikes = SpikeWatch(files)
        self.first: int | None = None
        """The first step of the current streak of non-finite losses (None: the last loss was finite)."""

    def see(self, step: int, loss: float) -> None:
        self.spikes.see(step, loss)
        if math.isfinite(loss):
            self.first = None
            return
        if self.first is None:
            self.first = step
        count = step - self.first + 1
        if count < self.limit:
            return
        where = (
            f"at step {step}"
            if count == 1
            else f"at {count} steps in a row, steps {self.first} to {step}"
        )
        lower = f"a lower train.lr (now {self.lr})"
        todo = f"resume from it with --resume and {lower}, or start a new run"
        if not self.files.steps():  # nothing to resume from
            todo = f"start a new run (another --name) with {lower}"
        raise ValueError(
            f"training diverged: non-finite loss ({loss}) {where} "
            f"(train.max_nonfinite_losses={self.limit}); {self.files.newest()}: {todo}"
        )

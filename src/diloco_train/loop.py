"""One worker's training loop as it goes (``worker.Worker`` runs it): what it trains and reports with,
and where it stands."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .data.corpus import BatchSampler
from .evals import EvalSchedule
from .modes import Sync
from .pace import Pace
from .report.metrics import Reporter
from .runs.divergence import LossWatch

__all__ = ["Loop"]


@dataclass
class Loop:
    """One worker's training loop as it goes: what it trains and reports with, and where it stands."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    sync: Sync
    pace: Pace
    reporter: Reporter | None
    """Rank 0's (metrics.jsonl, the bar); None on the other ranks."""
    evaluating: bool
    schedule: EvalSchedule
    watch: LossWatch
    end: int
    step: int
    saved: int
    """The step of this worker's newest checkpoint here (the resumed one; none: the step it started at)."""
    last_eval: float = math.nan

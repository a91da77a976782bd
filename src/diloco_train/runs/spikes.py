"""A loss spike: a finite loss far above the run's recent losses, and the checkpoint from before it (last good).

A wrecked model (an insider's update scaled by 1e6, a bad round) can stay finite for many rounds, and so be
checkpointed: with the usual rotation the good checkpoints before it are soon deleted. A worker's loss at
a step is a spike when it is at least ``FACTOR`` times the median of its last ``WINDOW`` finite losses
before it (which needs ``MIN_SEEN`` of them), and ``MARGIN`` nats above that median. The spike lasts while
its losses stay so high (the median is that of the losses before it); the first loss below the bar ends it.

The loss of step ``s + 1`` is computed on the state after step ``s``, the state that step ``s``'s
checkpoint holds: a spike first seen at step ``F`` condemns the checkpoint of step ``F - 1`` (a checkpoint
is written just after a round's outer step, and the loss of the next step is the first to show it). The
newest checkpoint of step ``F - 2`` or before is pinned (``checkpoint.pin``): rotation keeps it, in place of
the one pinned at an earlier spike, and a WARNING says so. It stays pinned across ``--resume``.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics

from .rank_files import RankFiles

__all__ = ["FACTOR", "MARGIN", "MIN_SEEN", "WINDOW", "SpikeWatch"]

logger = logging.getLogger(__name__)

FACTOR = 2.0
"""A spike's loss is at least this times the median before it."""
MARGIN = 1.0
"""... and at least this many nats above it (near 0, the batch noise alone can double a loss)."""
WINDOW = 16
"""Losses the median is taken over."""
MIN_SEEN = 8
"""Finite losses seen (in this process) before a spike can be called."""


class SpikeWatch:
    """One worker's losses; at the first step of a spike, the newest checkpoint before it is pinned."""

    def __init__(self, files: RankFiles) -> None:
        self.files = files
        self.recent: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.first: int | None = None
        """The first step of the current spike (None: the last finite loss was not one)."""

    def see(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            return  # LossWatch counts those; a state that is not finite is never checkpointed
        median = statistics.median(self.recent) if len(self.recent) >= MIN_SEEN else None
        if median is not None and loss >= FACTOR * median and loss - median >= MARGIN:
            if self.first is None:
                self.first = step
                self._pin_before(step, loss=loss, median=median)
            return  # a spike's losses never enter the median: it stays that of the losses before it
        self.first = None
        self.recent.append(loss)

    def _pin_before(self, step: int, *, loss: float, median: float) -> None:
        before = [s for s in self.files.steps() if s <= step - 2]
        spike = f"step {step}: loss {loss:.4g} is a spike ({loss / median:.3g}x the median {median:.4g} before it)"
        if not before:
            logger.warning("%s; no checkpoint from before it is on disk to keep", spike)
            return
        where = self.files.pin(before[-1], why=spike)
        logger.warning(
            "%s: the checkpoint of step %d, the newest before it, is kept out of rotation (%s)",
            spike,
            before[-1],
            where,
        )

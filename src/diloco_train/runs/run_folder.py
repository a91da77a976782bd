"""A run's folder and its layout: the one place that spells a path inside a run folder.

``runs/NAME/`` holds ``config.toml`` (the effective config), ``metrics.jsonl`` (rank 0's records),
``checkpoints/`` (each rank's: ``rank(r)``, a ``RankFiles``), ``plot.png`` (the trainer's, step
axis; ``diloco plot --x all`` writes ``plot-all.png`` beside it), ``join.secret`` (a secret this run
generated or was given on its command line, mode 600), ``tensorboard/`` (``train.log_to``) and one
``.owner-rank<r>`` lock per rank (``ownership``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .rank_files import RankFiles, checkpoint_ranks

__all__ = ["RunFolder"]


@dataclass(frozen=True)
class RunFolder:
    """The paths inside the run folder ``path`` (which need not exist yet)."""

    path: Path

    CONFIG = "config.toml"
    METRICS = "metrics.jsonl"
    OWNER = ".owner-rank"

    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def join_secret(self) -> Path:
        return self.path / "join.secret"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    def plot(self, x: str = "step") -> Path:
        """The run's plot: the trainer's ``plot.png`` (step axis), or ``plot-X.png`` for another axis."""
        return self.path / ("plot.png" if x == "step" else f"plot-{x}.png")

    def rank(self, rank: int) -> RankFiles:
        """``rank``'s checkpoints, their pin and stray temporary files."""
        return RankFiles(self.checkpoints, rank)

    def checkpoint_ranks(self) -> list[int]:
        """The ranks that have a checkpoint here, in order."""
        return checkpoint_ranks(self.checkpoints)

    def owner_lock(self, rank: int) -> Path:
        """The lock file of ``rank``'s claim on the folder (``ownership``)."""
        return self.path / f"{self.OWNER}{rank}"

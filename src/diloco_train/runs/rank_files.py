"""One rank's files in a checkpoints folder: its checkpoints, named ``stepNNNNNNNN-rankR.pt``, their
rotation, the pin that keeps one out of it, and the temporary files of its interrupted writes.

``RunFolder.rank(r)`` hands out a run's; a bare checkpoints folder (an export's, a benchmark's) makes its
own ``RankFiles(folder, rank)``. Rotation keeps a rank's newest ``keep`` checkpoints and its pinned one (the
newest before a loss spike, ``spikes.py``) and sees only files of that name: a resume renames those it
passed over aside (``resume_from.set_aside``), so a corrupt file never counts.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import atomic_save
from .checksum import CHECKSUM, checksum_of

__all__ = ["RankFiles", "checkpoint_ranks"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step(\d{8})-rank(\d+)\.pt$")


def checkpoint_ranks(folder: Path) -> list[int]:
    """The ranks that have a checkpoint in ``folder``, in order."""
    names = (_NAME.match(p.name) for p in folder.iterdir()) if folder.is_dir() else ()
    return sorted({int(m.group(2)) for m in names if m})


@dataclass(frozen=True)
class RankFiles:
    """``rank``'s files in the checkpoints folder ``folder`` (which need not exist yet)."""

    folder: Path
    rank: int

    def checkpoint(self, step: int) -> Path:
        """The path of this rank's checkpoint of ``step``."""
        return self.folder / f"step{step:08d}-rank{self.rank}.pt"

    def steps(self) -> list[int]:
        """Steps that this rank has a complete checkpoint of, oldest first."""
        if not self.folder.is_dir():
            return []
        names = (_NAME.match(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in names if m and int(m.group(2)) == self.rank)

    def save(self, step: int, state: dict[str, Any], *, keep: int) -> Path:
        """Write ``state`` and its checksum as this rank's checkpoint of ``step``; then delete all but its
        newest ``keep`` and its pinned one."""
        path = self.checkpoint(step)
        atomic_save({**state, CHECKSUM: checksum_of(state)}, path)
        kept = self.pinned()
        for old in self.steps()[:-keep]:
            if old != kept:
                self.checkpoint(old).unlink(missing_ok=True)
        logger.debug("rank %d: checkpoint of step %d written to %s", self.rank, step, path)
        return path

    @property
    def _pin(self) -> Path:
        return self.folder / f"pinned-rank{self.rank}.json"

    def pin(self, step: int, *, why: str) -> Path:
        """Keep this rank's checkpoint of ``step`` out of rotation (in place of the one pinned before),
        saying ``why`` in the file, written atomically like the checkpoints; that file."""
        tmp = self._pin.with_name(f".{self._pin.name}.tmp")
        tmp.write_text(json.dumps({"step": step, "why": why}) + "\n", encoding="utf-8")
        os.replace(tmp, self._pin)
        return self._pin

    def pinned(self) -> int | None:
        """The step of this rank's pinned checkpoint (None: none, or a pin file that cannot be read)."""
        try:
            step = json.loads(self._pin.read_text(encoding="utf-8"))["step"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return step if isinstance(step, int) else None

    def newest(self) -> str:
        """Where a diverged run can go back to, in words."""
        steps = self.steps()
        if not steps:
            return "no checkpoint was written yet"
        kept = self.pinned()
        spike = (
            f"; the newest before a loss spike is of step {kept}"
            if kept in steps and kept != steps[-1]
            else ""
        )
        return f"the newest checkpoint is of step {steps[-1]}{spike}"

    def remove_stray_temp(self) -> None:
        """Delete the temporary files of this rank's checkpoint writes that were interrupted (a killed
        process). Only the process that owns the rank calls this, before it writes: none is under way."""
        for stray in self.folder.glob(f".step*-rank{self.rank}.pt.*.tmp"):
            stray.unlink(missing_ok=True)
            logger.debug(
                "rank %d: removed %s, left by an interrupted checkpoint write", self.rank, stray
            )

"""Which checkpoint a resume starts from: each worker's newest one that can be read (and is finite), and,
where ranks hold for the run (in-process workers, torchrun), the newest step that every rank can read.

A checkpoint that cannot be read (truncated, overwritten, from a run that wrote NaN) is passed over with a
warning for an older one. Ranks agree in rounds: each offers its newest readable step at or below the
lowest offered so far, until all offer the same; every rank sees the same offers, so all end together.

Once every rank has loaded its checkpoint, each renames its files of steps after the one resumed from
aside (``set_aside``): those it could not read to ``NAME.corrupt``, the others (readable, but another rank
lacks the step) to ``NAME.unused``. Both are out of the run's path: the resumed run writes those steps
anew, and rotation, which sees only ``stepNNNNNNNN-rankR.pt`` names, can no longer keep one of them and
delete the intact checkpoint the run resumed from (nor can a later resume jump to them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco_core import Transport

from .checkpoint import load_checkpoint
from .divergence import all_finite
from .rank_files import RankFiles
from .run_folder import RunFolder

__all__ = ["Resume", "from_every_rank", "resume_step", "set_aside"]

logger = logging.getLogger(__name__)

_NONE = -1
"""Offered by a rank without checkpoints: every rank starts the run over (it crashed before its first)."""
_UNREADABLE = -2
"""Offered by a rank whose checkpoints all fail to read."""
_NO_COMMON = -3
"""Offered by a rank that can read none at or below the step the others offer."""


@dataclass(frozen=True)
class Resume:
    step: int
    """The step every rank resumes from; -1: none (the run starts over)."""
    state: dict[str, Any] | None
    """This rank's checkpoint of ``step``, read (None with -1)."""
    refused: frozenset[int] = frozenset()
    """The steps of this rank's checkpoints that were read and refused (unreadable, not finite)."""


def from_every_rank(transport: Transport, value: int, timeout: float) -> list[int]:
    """Each rank's ``value``, on every rank (collective). A rank that fails before it gets here fails it."""
    everyone = []
    for src in range(transport.world_size):
        buf = torch.tensor([value], dtype=torch.int64)
        transport.broadcast([buf], src=src, timeout=timeout)
        everyone.append(int(buf.item()))
    return everyone


class _Readable:
    """One rank's checkpoints, each read at most once, newest first; only the last one read is kept."""

    def __init__(self, files: RankFiles) -> None:
        self.files = files
        self.steps = files.steps()
        self.ok: dict[int, bool] = {}
        self.last: tuple[int, dict[str, Any]] | None = None

    def newest(self, bound: int | None) -> int:
        """The newest readable step at or below ``bound`` (None: any), else why there is none."""
        for step in reversed(self.steps):
            if (bound is None or step <= bound) and self._readable(step):
                return step
        if not self.steps:
            return _NONE
        return _NO_COMMON if any(self.ok.values()) else _UNREADABLE

    def state(self, step: int) -> dict[str, Any]:
        if self.last is None or self.last[0] != step:
            self._readable(step)
        assert self.last is not None and self.last[0] == step
        return self.last[1]

    def _readable(self, step: int) -> bool:
        if self.ok.get(step) is False:
            return False
        path = self.files.checkpoint(step)
        self.last = None  # one checkpoint in memory at a time
        try:
            state = load_checkpoint(path)
        except ValueError as e:
            logger.warning("%s: trying an older checkpoint", e)
            self.ok[step] = False
            return False
        if not all_finite(state.get("core")):
            logger.warning(
                "checkpoint %r holds NaN or infinite values: trying an older checkpoint", str(path)
            )
            self.ok[step] = False
            return False
        self.ok[step], self.last = True, (step, state)
        return True


def _refuse(everyone: list[int], *, folder: Path, bound: int | None) -> None:
    """The same error on every rank, where some rank has no checkpoint to offer."""
    unreadable = [r for r, v in enumerate(everyone) if v == _UNREADABLE]
    if unreadable:
        raise ValueError(
            f"none of the checkpoints of worker(s) {unreadable} in {str(folder)!r} can be read (the warnings "
            "above say why): start a new run (another --name), or delete them to start this one over"
        )
    behind = [r for r, v in enumerate(everyone) if v == _NO_COMMON]
    if behind:
        raise ValueError(
            f"workers hold no common readable checkpoint: worker(s) {behind} have none at or below step {bound}, "
            "the newest the others can read (train.keep_checkpoints may be too small)"
        )


def resume_step(run_dir: Path, *, rank: int, transport: Transport | None, timeout: float) -> Resume:
    """The step ``rank`` resumes from and its checkpoint of it. Ranks that hold for the run agree on the
    newest step all of them can read; peers that come and go have none to agree with: each takes its own."""
    readable = _Readable(RunFolder(run_dir).rank(rank))
    agree = (
        transport is not None and transport.capabilities.fixed_ranks and transport.world_size > 1
    )
    bound: int | None = None
    while True:
        mine = readable.newest(bound)
        everyone = (
            from_every_rank(transport, mine, timeout) if agree and transport is not None else [mine]
        )
        _refuse(everyone, folder=readable.files.folder, bound=bound)
        common = min(everyone)
        refused = frozenset(step for step, ok in readable.ok.items() if not ok)
        if common == _NONE:
            return Resume(step=_NONE, state=None, refused=refused)
        if all(v == common for v in everyone):
            return Resume(step=common, state=readable.state(common), refused=refused)
        bound = common


def set_aside(run_dir: Path, *, rank: int, resumed: Resume) -> None:
    """Rename ``rank``'s checkpoints of steps after ``resumed.step`` aside (``.corrupt``, ``.unused``); once
    every rank has loaded its checkpoint, so that a failed resume changes nothing."""
    files = RunFolder(run_dir).rank(rank)
    for step in files.steps():
        if step <= resumed.step:
            continue
        path = files.checkpoint(step)
        aside = path.with_name(path.name + (".corrupt" if step in resumed.refused else ".unused"))
        path.replace(aside)
        logger.warning(
            "resumed from step %d: %s renamed to %s (out of rotation and resumes)",
            resumed.step,
            path,
            aside.name,
        )

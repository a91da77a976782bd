"""Checkpoints: one file per worker and step, written atomically, read back with ``weights_only=True``.

A file is first written to a temporary name in the same folder, flushed to disk, then renamed over
its final name (``os.replace`` is atomic on POSIX and Windows): a crash mid-write leaves the previous
checkpoint as it was and, at worst, a stray ``.tmp`` file that the next save removes.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "atomic_save",
    "checkpoint_path",
    "checkpoint_ranks",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step(\d{8})-rank(\d+)\.pt$")


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj)`` to ``path`` so that ``path`` holds either the old or the whole new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # The rename itself is durable only once the directory entry is on disk (POSIX; no-op elsewhere).
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_path(folder: str | Path, step: int, rank: int) -> Path:
    return Path(folder) / f"step{step:08d}-rank{rank}.pt"


def list_checkpoints(folder: str | Path, rank: int) -> list[int]:
    """Steps that ``rank`` has a complete checkpoint of, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m and int(m.group(2)) == rank:
            steps.append(int(m.group(1)))
    return sorted(steps)


def checkpoint_ranks(folder: str | Path) -> list[int]:
    """The ranks that have a checkpoint in ``folder``, in order."""
    folder = Path(folder)
    names = (_NAME.match(p.name) for p in folder.iterdir()) if folder.is_dir() else ()
    return sorted({int(m.group(2)) for m in names if m})


def save_checkpoint(folder: str | Path, step: int, rank: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as ``rank``'s checkpoint of ``step``; then delete all but its newest ``keep``."""
    path = checkpoint_path(folder, step, rank)
    atomic_save(state, path)
    for old in list_checkpoints(folder, rank)[:-keep]:
        checkpoint_path(folder, old, rank).unlink(missing_ok=True)
    for stray in Path(folder).glob(f".step*-rank{rank}.pt.*.tmp"):
        stray.unlink(missing_ok=True)
    logger.debug("rank %d: checkpoint of step %d written to %s", rank, step, path)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint; only tensors and plain containers are accepted (nothing is unpickled)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, the user gets one clear ValueError
        raise ValueError(f"checkpoint {str(path)!r} cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {str(path)!r} holds a {type(state).__name__}, not a dict")
    return state

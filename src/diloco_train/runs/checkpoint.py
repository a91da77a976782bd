"""Checkpoints: one file per worker and step, written atomically, read back with ``weights_only=True``.

A file is first written to a temporary name in the same folder, flushed to disk, then renamed over
its final name (``os.replace`` is atomic on POSIX and Windows): a crash mid-write leaves the previous
checkpoint as it was and, at worst, a stray ``.tmp`` file that the rank's next start removes. A write that
fails (a full disk) is an OSError naming the file and the OS's reason; a file that cannot be read, a
ValueError saying why in one line (never torch's advice to load it unsafely).

Each checkpoint carries a checksum of its tensors and values (``checksum.py``) under the key ``"checksum"``,
verified when it is read: a file changed on disk after it was written (a flipped bit, a bad copy) is refused
with one line naming it. A checkpoint written before checksums (no such key) still loads, unverified, with
a warning saying so: refusing it would strand every run checkpointed by an older version.

A rank's files, their names and their rotation: ``rank_files.py``.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .checksum import CHECKSUM, checksum_of

__all__ = ["atomic_save", "load_checkpoint"]

logger = logging.getLogger(__name__)


def _open_temp(fd: int) -> BinaryIO:
    return os.fdopen(fd, "wb")


class _Recording:
    """The file as ``torch.save`` sees it: the first OSError of a write is kept, because torch reports a
    failed write as a RuntimeError of its own ("unexpected pos ...") that does not say why."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def atomic_save(
    obj: Any, path: str | Path, *, opener: Callable[[int], BinaryIO] = _open_temp
) -> None:
    """``torch.save(obj)`` to ``path`` so that ``path`` holds either the old or the whole new file. A failed
    write is an OSError naming ``path`` and why; ``path`` is left as it was and no temporary file stays.
    ``opener`` turns the temporary file's descriptor into the file written (tests pass one that fails)."""
    path = Path(path)
    tmp: str | None = None
    recording = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with opener(fd) as f:
            recording = _Recording(f)
            torch.save(obj, recording)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - whatever failed (torch, the OS), the user gets the OS's reason
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        cause = recording.error if recording is not None and recording.error is not None else e
        raise OSError(f"cannot write checkpoint {str(path)!r}: {_first_sentence(cause)}") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _first_sentence(e: BaseException) -> str:
    """An exception's message, its first sentence of its first line (torch's go on for a paragraph)."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"[Errno {e.errno}] {e.strerror}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text.split(". ")[0].rstrip(".")


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


def _unreadable(e: BaseException) -> str:
    """Why a checkpoint could not be read, in one line. torch's own message of a refused file advises
    loading it with ``weights_only=False`` (which can run any code): only its reason is kept."""
    if isinstance(e, pickle.UnpicklingError):
        reason = str(e).split("WeightsUnpickler error:")[-1]
        return f"not a file of tensors and plain containers ({_first_sentence(Exception(reason))})"
    return f"truncated or not a checkpoint ({_first_sentence(e)})"


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint and verify its checksum (without one: written before checksums, loaded with a
    warning); only tensors and plain containers are accepted (nothing is unpickled)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, the user gets one clear ValueError
        raise ValueError(f"checkpoint {str(path)!r} cannot be read: {_unreadable(e)}") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {str(path)!r} holds a {type(state).__name__}, not a dict")
    saved = state.pop(CHECKSUM, None)
    if saved is None:
        logger.warning(
            "checkpoint %r has no checksum (written before checksums): loaded unverified", str(path)
        )
        return state
    found = checksum_of(state)
    if saved != found:
        raise ValueError(
            f"checkpoint {str(path)!r} cannot be read: its checksum {saved} does not match its contents "
            f"({found}): the file changed after it was written (a flipped bit, a bad disk or copy)"
        )
    return state

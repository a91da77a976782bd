"""A run folder has one owner per worker: a process claims the ranks whose files it writes, for as long as it runs.

Each rank's claim is an exclusive ``flock`` on ``<run>/.owner-rank<r>``, which holds the owner's pid. The
kernel drops the lock when its process ends, however it ends, so a lock file left by a dead process never
blocks. A process claims every rank it writes files for: all of them where the workers are threads of
it, only its own rank under torchrun (each rank writes only its own checkpoints; rank 0 also the metrics,
config and plot), rank 0 for a peer without fixed ranks (a hivemind peer writes as rank 0). So a second
process that would write into a folder a live one owns (two peers started with the same ``--name``, a
second ``--resume`` of a running run) ends before writing anything, naming the folder and the owner.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from .run_folder import RunFolder

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there are not guarded
    fcntl = None  # type: ignore[assignment]

__all__ = ["RunOwner", "remove_unused"]


def remove_unused(run_dir: Path, *, spare: Callable[[Path], bool]) -> None:
    """Remove ``run_dir`` (a folder that a start which failed made) where it holds only lock files
    that no live process holds and files ``spare`` says carry nothing; else leave it as it is."""
    try:
        entries = list(run_dir.iterdir())
        lock = RunFolder.OWNER
        tails = [p.name[len(lock) :] for p in entries if p.name.startswith(lock)]
        ranks = [int(r) for r in tails if r.isdigit()]
        if len(ranks) + sum(map(spare, entries)) < len(entries):
            return
        owner = RunOwner(run_dir, ranks)  # a ValueError where a live process holds one
    except (OSError, ValueError):
        return
    try:
        for path in entries:
            path.unlink()
        run_dir.rmdir()
    except OSError:
        pass  # something came in meanwhile: it stays
    finally:
        owner.release()


class RunOwner:
    """This process's claim on ``ranks`` of ``run_dir`` (created if missing); ValueError if a live process
    holds one of them. ``release()`` (or the end of the process) gives them up."""

    def __init__(self, run_dir: Path, ranks: Iterable[int]) -> None:
        self.files: list[IO[str]] = []
        if fcntl is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            for rank in ranks:
                self._claim(run_dir, rank)
        except BaseException:
            self.release()
            raise

    def _claim(self, run_dir: Path, rank: int) -> None:
        path = RunFolder(run_dir).owner_lock(rank)
        # never truncated before the lock is ours: it names the owner
        f = path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise ValueError(
                f"run {str(run_dir)!r} is in use by process {owner} (it holds {path.name}): wait for it to end, "
                "or give this process another --name"
            ) from None
        except BaseException:
            f.close()
            raise
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.files.append(f)

    def release(self) -> None:
        """Give the claims up (the files stay: the next owner overwrites the pid). Idempotent."""
        for f in self.files:
            f.close()  # closing the last descriptor of the file drops its flock
        self.files = []

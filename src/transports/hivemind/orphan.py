"""A peer's hivemind processes (its DHT and averagers) leave when the process that started them dies.

They are children of the trainer's process; killed with SIGKILL (or by the OOM killer), it runs no cleanup, and
they lived on as orphans: the state averager kept refreshing the peer's presence, so the survivors kept waiting
for a peer that would never come (measured: every round 17 s instead of 4), and the DHT's p2pd kept its port.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["leave_with_parent"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc; none where there is no /proc)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # not a process, or gone
            continue
        if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def leave_with_parent(period: float = 1.0, *, cleanup: Callable[[], None] | None = None) -> None:
    """In a child process: watch its parent from a daemon thread (every ``period`` seconds); once the parent is
    gone, kill this process's own children (the DHT's p2pd), run ``cleanup`` (its socket files: an exit this
    abrupt runs no other) and exit at once."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        for pid in _children(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            if cleanup is not None:
                cleanup()
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="leave-with-parent", daemon=True).start()

"""The unix socket files a peer's hivemind processes bind in /tmp, and removing those nothing serves any more.

hivemind names them at random (``hivemind-p2pd-*.sock``, ``hivemind-p2pclient-*.sock``) and removes them only on
a clean shutdown: a p2pd that ended first, or an averager process that was killed, left its file in /tmp. The
parent records each averager's files once it is up (``bound_by``: from /proc, Linux only) and removes them at
``close`` once nothing has them bound (``remove_stale``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
from pathlib import Path

__all__ = ["bound_by", "daemon_sockets", "remove_new_stale", "remove_stale"]

DAEMON_SOCKETS = "/tmp/hivemind-p2pd-*.sock"


def daemon_sockets() -> set[str]:
    """The p2p daemons' socket files in /tmp now (any process's): a daemon that failed to start leaves
    its file behind, unnamed to us; the files that appeared meanwhile and nothing binds are its."""
    return set(glob.glob(DAEMON_SOCKETS))


def remove_new_stale(before: set[str]) -> None:
    """Remove the daemon socket files that appeared since ``before`` (``daemon_sockets()``) and that
    nothing binds."""
    for path in daemon_sockets() - before:
        remove_stale(path, wait=0.5)


def _bound() -> dict[str, str]:
    """Bound unix sockets of this network namespace: inode -> path (empty where there is no /proc)."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return {}
    return {parts[6]: parts[7] for parts in map(str.split, lines) if len(parts) >= 8}


def bound_by(pid: int, *, prefix: str = "/tmp/hivemind-") -> list[str]:
    """The socket files under ``prefix`` that process ``pid`` has bound (none where /proc cannot tell)."""
    bound, inodes = _bound(), set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    return sorted(bound[i] for i in inodes if i in bound and bound[i].startswith(prefix))


def remove_stale(path: str | None, *, wait: float = 3.0) -> None:
    """Remove the socket file ``path`` once nothing has it bound, waiting up to ``wait`` seconds for that (left
    alone where /proc cannot tell, or while it is still bound then)."""
    deadline = time.monotonic() + wait
    while path is not None and os.path.exists(path):
        if not Path("/proc/net/unix").exists():
            return
        if path not in _bound().values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.1)

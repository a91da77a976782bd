"""Ranks, or any calls, as threads of this process: the one runner the in-process tests share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from diloco_core import Transport
from transports import InProcessGroup


def _started_and_joined(body: Callable[[int], None], n: int, timeout: float) -> list[threading.Thread]:
    """``body(i)`` for i in range(n), each in a daemon thread of its own (one that hangs never blocks the test
    run's exit), joined for up to ``timeout`` seconds each; returns the threads."""
    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return threads


def in_threads(body: Callable[[int], None], n: int, *, timeout: float, what: str = "threads") -> None:
    """``body(i)`` for i in range(n), each in its own thread; all must finish within ``timeout``."""
    threads = _started_and_joined(body, n, timeout)
    assert not any(t.is_alive() for t in threads), f"{what} still running after {timeout}s"


def together(calls: list[Callable[[], Any]], timeout: float = 90) -> list:
    """Run the zero-argument ``calls`` at once; return their results or exceptions (None: still running)."""
    out: list = [None] * len(calls)

    def body(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[i] = e

    _started_and_joined(body, len(calls), timeout)
    return out


def run_threads(world_size: int, fn: Callable[[Transport], object], *, timeout: float = 50) -> list:
    """``fn(transport)`` on ``world_size`` threads of one in-process group; re-raises a rank's error."""
    group = InProcessGroup(world_size)
    results: list = [None] * world_size
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(group.transport(rank))
        except BaseException as e:  # noqa: BLE001 - the first one is raised in the test's thread
            errors.append(e)

    in_threads(body, world_size, timeout=timeout, what="ranks")
    if errors:
        raise errors[0]
    return results

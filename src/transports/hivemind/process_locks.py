"""hivemind's process-wide locks, made per process so that a killed process can never leave one held.

hivemind creates three ``multiprocessing.Lock`` objects when it is imported (``SharedBytes._lock``,
``MPFuture._initialization_lock``, ``_AsyncContextWrapper.EXECUTOR_LOCK``). Every process forked after that
(each DHT and averager of every peer in the same program, e.g. a test run) shares the very same semaphores,
although each guards state of one process only (a buffer, a backend, an executor, each checked against
``os.getpid()``). A process killed while it held one left it held for all: a CI run hung in
``SharedBytes.next`` after a child was killed. Each is replaced by a ``threading.Lock`` of the process,
renewed in every forked child (``os.register_at_fork``), so a child never inherits one held by a parent's
thread either. ``MPFuture._update_lock`` stays shared: it keeps writes of several processes to one pipe apart.

These are private attributes of hivemind (pinned in pyproject.toml: check them before widening the pin).
"""

import os
import threading

__all__ = ["install"]

_installed = False


def _renew() -> None:
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    SharedBytes._lock = threading.Lock()
    MPFuture._initialization_lock = threading.Lock()
    _AsyncContextWrapper.EXECUTOR_LOCK = threading.Lock()


def install() -> None:
    """Make hivemind's per-process locks this process's own, and each forked child's its own. Idempotent."""
    global _installed
    if _installed:
        return
    _renew()
    os.register_at_fork(after_in_child=_renew)
    _installed = True

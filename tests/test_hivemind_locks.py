"""No lock a killed process can leave held: hivemind's per-process locks (transports/hivemind/process_locks.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def _lock(which: str):
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    return {
        "shared_bytes": SharedBytes._lock,
        "initialization": MPFuture._initialization_lock,
        "executor": _AsyncContextWrapper.EXECUTOR_LOCK,
    }[which]


def _hold_and_die(which: str) -> None:
    _lock(which).acquire()
    os.kill(os.getpid(), signal.SIGKILL)  # killed while holding it, as a test's child or a crashed peer is


@pytest.mark.parametrize("which", ["shared_bytes", "initialization", "executor"])
def test_a_child_killed_holding_a_hivemind_lock_blocks_nobody(which):
    """The CI hang: pytest's main thread waited forever in ``SharedBytes.next`` after a child was killed holding
    the lock every hivemind process of the run shared (on the old code, the parent's acquire times out here)."""
    from hivemind.utils.mpfuture import SharedBytes

    import transports.hivemind  # noqa: F401 - importing the transport makes the locks per process

    child = mp.get_context("fork").Process(target=_hold_and_die, args=(which,))
    child.start()
    child.join(20)
    assert child.exitcode == -signal.SIGKILL
    lock = _lock(which)
    assert lock.acquire(timeout=5), f"hivemind's {which} lock is still held by the killed child"
    lock.release()
    if which == "shared_bytes":  # and the call that hung in CI returns
        assert SharedBytes.next().dtype == torch.uint8


def test_a_child_forked_while_a_thread_holds_the_lock_gets_its_own():
    """A child forked while a parent's thread holds a lock starts with a free one of its own."""
    import transports.hivemind  # noqa: F401

    lock = _lock("shared_bytes")
    ctx = mp.get_context("fork")
    with lock:
        child = ctx.Process(target=_acquire_or_fail)
        child.start()
    child.join(20)
    assert child.exitcode == 0


def _acquire_or_fail() -> None:
    os._exit(0 if _lock("shared_bytes").acquire(timeout=5) else 3)

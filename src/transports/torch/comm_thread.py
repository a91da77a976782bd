"""The torch transport's communication thread: it issues every collective of its transport, in order.

torch.distributed pairs collectives by their order on each rank, nothing else. So one thread per
transport issues them all, job after job in the order they were submitted (a reduce: its identity
header, then its buckets; a broadcast), and no collective from the caller's thread can slip between two
of a background job's. A reduce thus runs to completion while its caller trains on, and ``wait`` only
waits for it.

A job whose caller gave up on it (its wait timed out) or whose transport closed is cancelled: it issues
no further collective and no more arithmetic on the caller's tensors (collectives already posted may still
complete) from the moment its current wait ends (at once for collectives that have a future, within the
process group's timeout for point-to-point ones).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diloco_core.transport import TransportError

__all__ = ["CommThread", "Job", "on_stream"]

_POLL = 0.05  # seconds between checks for cancellation while a collective is on the wire


class Job:
    """One unit of work for the communication thread: ``body(job)`` runs there; its value or exception is
    kept for ``outcome``. ``stage`` says how far it got (for the caller's timeout message)."""

    def __init__(self, body: Callable[[Job], Any]) -> None:
        self._body = body
        self.done = threading.Event()
        self.stage = "queued"
        self._cancelled: str | None = None
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            # grad mode is per thread: the caller's no_grad does not reach this one
            with torch.no_grad():
                self._value = self._body(self)
        except BaseException as e:  # noqa: BLE001 - every failure is the caller's, raised by its wait
            self._error = e
        finally:
            self.done.set()

    def cancel(self, reason: str) -> None:
        """Issue nothing more: the job raises ``TransportError(reason)`` at its next check."""
        if self._cancelled is None:
            self._cancelled = reason

    def check(self) -> None:
        if self._cancelled is not None:
            raise TransportError(self._cancelled)

    def outcome(self) -> Any:
        """The body's value, or its exception raised (once ``done`` is set)."""
        if self._error is not None:
            raise self._error
        return self._value

    def await_work(self, work: Any) -> None:
        """Wait for a collective's work, raising its error; checks for cancellation meanwhile where the work
        has a future (gloo's point-to-point works have none: those are waited for as they are)."""
        try:
            future = work.get_future()
        except RuntimeError:  # "getFuture not implemented"
            future = None
        if future is not None:
            finished = threading.Event()
            future.add_done_callback(functools.partial(_set_when_done, finished))
            while not finished.wait(_POLL):
                self.check()
        work.wait()  # at once when finished; raises the collective's error
        self.check()


class CommThread:
    """A FIFO of jobs run by one daemon thread, started with the first job and stopped by ``close``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: set[Job] = set()  # submitted, not yet done
        self._closed = False

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.add(job)
            self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.run()
            with self._lock:
                self._jobs.discard(job)
            del job  # its tensors are the caller's handle's to keep, not this thread's

    def stopped(self) -> bool:
        """The thread has ended (or never started): no collective of this transport is under way."""
        with self._lock:
            thread = self._thread
        return thread is None or not thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel every job not yet done and stop the thread (waiting at most ``timeout`` seconds for it: a
        job stuck in a point-to-point wait ends within the process group's timeout). Idempotent."""
        with self._lock:
            self._closed = True
            thread, jobs = self._thread, list(self._jobs)
        for job in jobs:
            job.cancel("transport is closed")
        if thread is not None:
            self._queue.put(None)
            # a transport collected in this thread closes it too
            if thread is not threading.current_thread():
                thread.join(timeout)


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """The caller's CUDA device and stream in the communication thread (both are per thread), so that its
    kernels and collectives are ordered with the caller's work on that stream; nothing for CPU tensors."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def _set_when_done(finished: threading.Event, _future: Any) -> None:
    """The backend's callback once a collective's future completes: the communication thread waits on it."""
    finished.set()

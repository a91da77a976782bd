"""Ctrl+C (SIGINT) and SIGTERM (what SLURM, Kubernetes and spot reclaim send before they kill a job).

The handlers are installed explicitly (``signal.signal``), so a trainer started with SIGINT ignored (a
background job of a non-interactive shell: ``diloco train &`` in a script) still hears it. The first signal
asks the run to stop softly where it can (``soft``: in-process workers agree on a step, checkpoint it and
leave); where it cannot (a worker of a multi-process run, or before a worker has begun a step: nothing to
checkpoint), and at a second signal, it raises KeyboardInterrupt at once, as Python's SIGINT handler does.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["INTERRUPTS", "Interrupts"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """The process's stop requests: which signal came first, and who stops softly on it."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.deferring = 0
        self.pending = False
        self.soft: Callable[[], bool] | None = None
        """Asks the run to stop softly; False: it cannot (nothing to checkpoint yet), so stop at once."""

    @property
    def status(self) -> int:
        """The exit status of a process that a signal ended: 128 + its number (130 for SIGINT)."""
        return 128 + (self.received or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.received or signal.SIGINT).name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if first and self.soft is not None and self.soft():
            return  # the workers stop at a step they agree on, checkpoint it and return
        if self.deferring:
            self.pending = True  # raised once the checkpoint being written is whole (``deferred``)
            return
        raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal to the main thread waits for the block's end (a checkpoint is not cut mid-file: torch
        would report the write as failed). Other threads' blocks need nothing: the signal is not raised there."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if self.pending and not self.deferring:
            self.pending = False
            raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """SIGINT and SIGTERM handled here for the block (the previous handlers restored after it)."""
        self.received = None
        self.soft = None
        self.pending = False
        if threading.current_thread() is not threading.main_thread():  # only it may set handlers
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        try:
            yield self
        finally:
            self.soft = None
            for s, handler in previous.items():
                signal.signal(s, handler)

    def stop_softly(self, request: Callable[[], bool]) -> Callable[[], None]:
        """``request`` answers the first signal from now on; call the returned function to withdraw it."""
        self.soft = request

        def withdraw() -> None:
            if self.soft is request:
                self.soft = None

        return withdraw

    @staticmethod
    def ignore() -> None:
        """After the first signal has been answered: later ones (a second Ctrl+C, torchrun's SIGTERM) add nothing."""
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)


INTERRUPTS = Interrupts()
"""One per process, as signal handlers are."""

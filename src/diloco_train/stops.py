"""How one invocation's workers stop together: at once where one of them failed, or, where a signal asked
the run to stop, each at the same step, which they checkpoint."""

from __future__ import annotations

import threading

__all__ = ["Stops"]


class Stops:
    """The one owner of an invocation's stopping, shared by its worker threads (under its lock)."""

    def __init__(self) -> None:
        self._now = threading.Event()
        self._lock = threading.Lock()
        self._interrupted = False
        self._stop_at: int | None = None
        self._begun: dict[
            int, int
        ] = {}  # each worker's step once it has begun it (the one it will reach)

    @property
    def now(self) -> bool:
        """A worker failed (or the launching thread was interrupted): the others leave their loop."""
        return self._now.is_set()

    @property
    def interrupted(self) -> bool:
        """A signal asked the run to stop: its workers stop at one step (``here``), checkpoint it and leave."""
        with self._lock:
            return self._interrupted

    def at_once(self) -> None:
        """Every worker leaves its loop at its next step (one failed, or the launcher was interrupted)."""
        self._now.set()

    def softly(self) -> bool:
        """From the signal handler: every worker of this process stops at the same step (``here``) and
        checkpoints it. False where no worker has begun a step: nothing new to checkpoint, stop at once."""
        with self._lock:
            self._interrupted = bool(self._begun)
            return self._interrupted

    def here(self, rank: int, step: int) -> bool:
        """Whether ``rank``, about to begin the step after ``step``, stops instead. Once interrupted, the workers
        stop at the furthest step one of them has begun (they may be a round apart), so each stops at that one
        step and checkpoints it; none begins a step past it."""
        with self._lock:
            if self._interrupted and self._stop_at is None:
                self._stop_at = max(self._begun.values(), default=step)
            if self._stop_at is not None and step >= self._stop_at:
                return True
            self._begun[rank] = step + 1
            return False

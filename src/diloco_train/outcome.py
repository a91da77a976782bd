"""What one invocation's workers hand back to the launching thread: their errors, rank 0's reporter and
result, each worker's busy seconds, and the one warning said once per process."""

from __future__ import annotations

import threading

from diloco_core import TransportError

from .report.metrics import Reporter, TrainResult

__all__ = ["Outcome"]


class Outcome:
    """The one owner of what an invocation's worker threads report back (under its lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._busy: dict[int, float] = {}
        self._reporter: Reporter | None = None
        self._result: TrainResult | None = None
        self._warned_nonfinite = False

    def failed(self, error: BaseException) -> None:
        """A worker thread raised ``error``, for the launching thread to re-raise."""
        with self._lock:
            self._errors.append(error)

    def cause(self) -> BaseException | None:
        """The first error that is not a transport failing because of another (else the first; None)."""
        with self._lock:
            errors = list(self._errors)
        return next(
            (e for e in errors if not isinstance(e, TransportError)), errors[0] if errors else None
        )

    def busy(self, rank: int, seconds: float) -> None:
        """``rank``'s busy seconds so far (``Pace``), for rank 0's goodput when every worker is here."""
        with self._lock:
            self._busy[rank] = seconds

    def busy_seconds(self) -> list[float]:
        with self._lock:
            return list(self._busy.values())

    def opened(self, reporter: Reporter) -> Reporter:
        """Rank 0's reporter, once it has started (closed by ``close``)."""
        self._reporter = reporter
        return reporter

    def finished(self, result: TrainResult) -> None:
        """Rank 0's result, once it has finished."""
        self._result = result

    @property
    def result(self) -> TrainResult | None:
        return self._result

    def first_nonfinite_state(self) -> bool:
        """True the first time a worker of this process says a state of its was not finite (said once)."""
        with self._lock:
            first = not self._warned_nonfinite
            self._warned_nonfinite = True
            return first

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.close()

"""Log lines say which worker wrote them: ``[worker R]`` (its rank) or ``[peer shard K]`` (no fixed ranks).

The tag is a context variable: each worker thread sets its own, and a worker process its main thread's;
lines from other threads (a transport's) carry ``[-]``.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

__all__ = ["AboveTheBar", "configure_logging", "set_worker"]

_WORKER: ContextVar[str] = ContextVar("diloco_worker", default="-")
_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(worker)s]: %(message)s"


def set_worker(tag: str) -> None:
    """Tag this thread's log lines with ``tag`` (e.g. ``worker 1``)."""
    _WORKER.set(tag)


class _Tag(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = _WORKER.get()
        return True


class AboveTheBar(logging.StreamHandler):
    """A stream handler whose lines go above the progress bar (tqdm's), never onto the bar's line: the bar
    is cleared for the line and drawn again below it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # no bar without tqdm (an optional extra): nothing to write around
            super().emit(record)
            return
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def configure_logging(level: int) -> None:
    """Log to stderr at ``level``, each line tagged with its worker (unless logging is configured already)."""
    handler = AboveTheBar()
    handler.addFilter(_Tag())
    handler.setFormatter(logging.Formatter(_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])

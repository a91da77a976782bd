"""``Throttle``: a warning about requests that anyone who reaches a peer can repeat at will.

One line per request let an outsider fill a peer's log (and its disk) as fast as it could send: the first is
logged at once, then at most one line per ``period`` that counts those since the last line.
"""

from __future__ import annotations

import logging
import time

__all__ = ["Throttle"]

logger = logging.getLogger(__name__)

PERIOD = 60.0
"""Seconds between two lines of one ``Throttle``."""


class Throttle:
    """Counts one kind of refused request; logs a WARNING at most once per ``period`` seconds."""

    def __init__(self, what: str, *, period: float = PERIOD) -> None:
        self.what, self.period = what, period
        self.count = 0
        """Requests counted since this throttle was made."""
        self._unlogged = 0
        self._last: float | None = None

    def tick(self, detail: str = "") -> None:
        """Count one; log if the last line is ``period`` old (``detail``: about this one, e.g. its sender)."""
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if self._last is not None and now - self._last < self.period:
            return
        since = "" if self._last is None else f" in the last {now - self._last:.0f} s"
        more = f"; at most one line per {self.period:g} s" if self._last is None else ""
        suffix = f" (latest: {detail})" if detail else ""
        logger.warning("%s: %d%s%s%s", self.what, self._unlogged, since, suffix, more)
        self._last, self._unlogged = now, 0

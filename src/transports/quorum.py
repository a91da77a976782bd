"""Quorum and grace window: when a round may close without every member (elastic rounds, docs/elastic.md).

A round closes once every member has contributed, or once ``members`` have and a grace window has passed since:
what arrives later is dropped from that round and counted (the late member receives the round's result and
goes on from it, in phase with the others: no state download). The window adapts to the measured slack: it is
``SLACK_FACTOR`` times the median, over the last ``HISTORY`` rounds every member made, of the time from the
quorum to the last arrival (at least ``MIN_GRACE``), and never more than ``grace_seconds``. So where workers
arrive close together (elastic rounds end on time) a straggler is waited for about as long as one usually
is, and a stalled one costs at most ``grace_seconds``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_core.rules import check_fields, integer, number

__all__ = ["HISTORY", "MIN_GRACE", "QUORUM_KEYS", "SLACK_FACTOR", "Grace", "Quorum", "quorum_from"]

QUORUM_KEYS = ("quorum", "grace_seconds")
"""The keys of a [transport] section that set its ``Quorum`` (in-process: ``InProcessConfig``'s)."""

HISTORY = 8
SLACK_FACTOR = 3.0
MIN_GRACE = 0.05


@dataclass(frozen=True, kw_only=True)
class Quorum:
    members: int = field(default=0, metadata=integer(low=0))
    """Contributions a round needs before it may close without the others (0: every member, no grace window)."""
    grace_seconds: float = field(
        default=5.0, metadata=number(gt=0, noun="a finite number of seconds")
    )
    """The longest a round that has its quorum waits for the others."""

    def __post_init__(self) -> None:
        check_fields(self)


def quorum_from(section: Mapping[str, Any]) -> Quorum:
    """The ``Quorum`` of a [transport] section (``QUORUM_KEYS``; unset: its defaults), checked."""
    given = {
        "members": section.get("quorum", 0),
        "grace_seconds": section.get("grace_seconds", 5.0),
    }
    try:
        return Quorum(**given)
    except ValueError as e:
        raise ValueError(f"[transport] {e}".replace("members=", "quorum=")) from None


class Grace:
    """The grace window of each reduce key, from the slack its full rounds showed (``Quorum``)."""

    def __init__(self, quorum: Quorum, *, floor: float = MIN_GRACE) -> None:
        """``floor``: the shortest window (``MIN_GRACE``; longer where meeting takes time: hivemind's DHT)."""
        self.quorum, self.floor = quorum, floor
        self._slack: dict[str, deque[float]] = {}

    def window(self, key: str) -> float:
        """Seconds a round of ``key`` that has its quorum waits for the other members."""
        seen = self._slack.get(key)
        if not seen:
            return self.quorum.grace_seconds
        return min(
            self.quorum.grace_seconds, max(self.floor, SLACK_FACTOR * statistics.median(seen))
        )

    def measured(self, key: str) -> bool:
        """Whether a full round of ``key`` has been measured (``window`` is then adaptive, not the bound)."""
        return bool(self._slack.get(key))

    def full_round(self, key: str, slack: float) -> None:
        """A round of ``key`` that every member made, its last ``slack`` seconds after its quorum."""
        self._slack.setdefault(key, deque(maxlen=HISTORY)).append(slack)

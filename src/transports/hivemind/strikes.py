"""``Strikes``: a peer the robust merge left out of several rounds in a row is left out of matchmaking a while.

The merge (``diloco_core.merge``) already keeps such a peer's contribution out of each round it is far in; this
saves the swarm the peer's traffic and time too. Each averager counts, per groupmate, the rounds in a row in which
a part it merged left that groupmate out; after ``after`` of them the peer is benched for ``seconds``: as a
leader, this averager turns its join requests away; in a group a benched peer leads (hivemind's followers choose
their leader) this averager sends nothing and takes nothing from it (``state_tag.stale_verdict``'s ``distrusted``:
the attempt is retried without it). With the block codecs every peer merges every part, so every peer benches the
same peers; with the casts, the peers that reduced its parts do (a groupmate that did not bench it waits out the
attempt's timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

__all__ = ["AFTER", "Strikes"]

logger = logging.getLogger(__name__)

AFTER = 3
"""Rounds in a row a peer is left out of before it is benched."""


class Strikes:
    def __init__(self, *, after: int = AFTER, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after, self.seconds, self.clock = after, seconds, clock
        self._in_a_row: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def round(self, group: Iterable[str], left_out: Iterable[str]) -> None:
        """A round of ``group`` (peer ids) finished, leaving out ``left_out``."""
        out = set(left_out)
        for peer in group:
            n = self._in_a_row[peer] = self._in_a_row.get(peer, 0) + 1 if peer in out else 0
            if n >= self.after and not self.benched(peer):
                self._until[peer] = self.clock() + self.seconds
                logger.warning(
                    "peer %s was left out of %d rounds in a row by the robust merge: left out of matchmaking "
                    "for %.0f s",
                    peer,
                    n,
                    self.seconds,
                )

    def benched(self, peer: str) -> bool:
        until = self._until.get(peer)
        if until is not None and until <= self.clock():
            del self._until[peer]
            self._in_a_row[peer] = 0
            return False
        return until is not None

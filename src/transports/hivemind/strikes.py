"""``Strikes``: a peer the robust merge left out of ``after`` of its last ``window`` rounds, or
whose part exchange failed a round, is left out of matchmaking a while.

The merge (``diloco_core.merge``) already keeps such a peer's contribution out of each round it is
far in; this saves the swarm the peer's traffic and time too. Each averager counts, per groupmate,
its strikes over the last ``window`` rounds it was in: a round in which a part this averager merged
left it out (``round``), or one whose exchange it failed (``failed``: it sent nothing, answered with
an error, or relayed nothing in time; ``blame``). ``after`` left-outs among its last ``window``
rounds bench it (honest diversity is left out now and then, an attacker in most rounds); a failed
exchange benches it at once, since every attempt with it fails on every groupmate and the round's
retry must go without it, for a tenth of ``seconds`` the first time and twice as long at each
failure after, up to ``seconds`` (``FailedExchanges``: an honest peer whose matchmaking timed out
as its group formed is back two matchmaking windows later, not twenty). A benched peer is left
out: as a leader, this averager turns its join requests away; in a group a benched peer leads
(hivemind's followers choose their leader) this averager sends nothing and takes nothing from it
(``state_tag.stale_verdict``'s ``distrusted``: the attempt is retried without it). Every peer merges
every part (casts too), so
every peer benches the same peers. One log line names each bench and
its reason (a failed exchange's: the transport's, which also stops waiting for the peer,
``swarm.Swarm.bench``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

__all__ = [
    "AFTER",
    "BENCH_MATCHMAKINGS",
    "FIRST_BENCH_SHARE",
    "WINDOW",
    "FailedExchanges",
    "Strikes",
]

logger = logging.getLogger(__name__)

AFTER = 3
"""Left-outs among a peer's last ``WINDOW`` rounds that bench it."""
WINDOW = 10
"""The rounds a peer's left-outs are counted over (the rounds it was in this averager's group)."""
BENCH_MATCHMAKINGS = 20
"""A bench lasts this many ``matchmaking_time`` (5 minutes at the default 15 s)."""
FIRST_BENCH_SHARE = 0.1
"""A peer's first failed exchange benches it for this share of a bench (2 ``matchmaking_time``)."""


class FailedExchanges:
    """Per peer, its failed exchanges one after another and the bench each earns: ``longest`` x
    ``FIRST_BENCH_SHARE`` for the first, twice the one before for each after, at most ``longest``; a
    peer without a failure for 2 x ``longest`` starts from the first again."""

    def __init__(self, *, longest: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.longest = longest
        self.clock = clock
        self._last: dict[str, tuple[int, float]] = {}  # per peer: failures in a row, when the last

    def bench_seconds(self, peer: str) -> float:
        """Count a failed exchange of ``peer``; the seconds it is benched for."""
        now = self.clock()
        count, when = self._last.get(peer, (0, -math.inf))
        count = count + 1 if now - when < 2 * self.longest else 1
        self._last[peer] = (count, now)
        return self.longest * min(1.0, FIRST_BENCH_SHARE * 2 ** (count - 1))


class Strikes:
    def __init__(
        self,
        *,
        after: int = AFTER,
        window: int = WINDOW,
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= after <= window:
            raise ValueError(f"after={after!r}, window={window!r}: expected 1 <= after <= window")
        self.after = after
        self.window = window
        self.seconds = seconds
        self.clock = clock
        # per peer: its last rounds, True where it was struck
        self._history: dict[str, deque[bool]] = {}
        self._until: dict[str, float] = {}
        self._failures = FailedExchanges(longest=seconds, clock=clock)

    def round(self, group: Iterable[str], left_out: Iterable[str]) -> None:
        """A round of ``group`` (peer ids) finished, leaving out ``left_out``."""
        out = set(left_out)
        for peer in group:
            history = self._history.setdefault(peer, deque(maxlen=self.window))
            history.append(peer in out)
            n = sum(history)
            if peer in out and n >= self.after and not self.benched(peer):
                self._bench(peer, self.seconds)
                logger.warning(
                    "peer %s was left out by the robust merge in %d of its last %d rounds: "
                    "left out of matchmaking for %.0f s",
                    peer,
                    n,
                    len(history),
                    self.seconds,
                )

    def failed(self, peers: Iterable[str], reason: str) -> None:
        """The exchange of a round failed with ``peers`` (``blame``): a strike each, and a bench at
        once (``FailedExchanges``; the transport names them, with ``reason``)."""
        for peer in peers:
            self._history.setdefault(peer, deque(maxlen=self.window)).append(True)
            if not self.benched(peer):
                seconds = self._failures.bench_seconds(peer)
                self._bench(peer, seconds)
                logger.debug(
                    "peer %s benched for %.0f s: its part exchange failed (%s)",
                    peer,
                    seconds,
                    reason,
                )

    def _bench(self, peer: str, seconds: float) -> None:
        self._until[peer] = self.clock() + seconds

    def benched(self, peer: str) -> bool:
        until = self._until.get(peer)
        if until is not None and until <= self.clock():
            del self._until[peer]
            self._history.pop(peer, None)  # its time is up: it counts from zero again
            return False
        return until is not None

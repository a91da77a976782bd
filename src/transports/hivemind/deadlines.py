"""Every deadline of a hivemind reduce, derived in one place from the two settings that bound it:
``matchmaking_time`` and ``averaging_timeout`` (``HivemindConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from .hivemind_config import HivemindConfig

__all__ = ["Deadlines", "deadlines"]

MATCHMAKINGS_PER_ATTEMPT = 2
"""An attempt's matchmaking may take twice ``matchmaking_time``: hivemind waits that long for groupmates
(``min_matchmaking_time``), and a follower then waits for its leader, who may have started its own wait later."""
ATTEMPT_SLACK = 10.0
"""Seconds an attempt may take beyond its matchmaking and ``averaging_timeout``: the confirmations every peer
sends its groupmates (phase 4) and the averager's process handing the result back."""
MATCHMAKINGS_PER_REDUCE = 4
"""A reduce retries until ``averaging_timeout + 4 * matchmaking_time`` after it started: room for one failed
attempt (its matchmaking, then up to ``averaging_timeout``) and a regroup among the survivors (another
attempt's matchmaking)."""
PRESENCE_LOOKUP = 2.0
"""Seconds at most for reading the swarm's presence records (whom a reduce waits for) from the DHT; never more
than ``matchmaking_time``."""


@dataclass(frozen=True, kw_only=True)
class Deadlines:
    """Seconds each stage of a reduce may take (``deadlines`` derives them)."""

    presence: float
    """Reading who is in the swarm before a reduce."""
    matchmaking: float
    """One attempt's matchmaking."""
    attempt: float
    """One attempt, from the start of its matchmaking until its result is back."""
    retries: float
    """A reduce's attempts: none starts after this much time from the reduce's start (and none without a
    matchmaking's worth left)."""
    own_timeout: float
    """The longest one ``all_reduce`` runs by itself: its retries, the last of which may take an attempt."""


def deadlines(config: HivemindConfig) -> Deadlines:
    """The one place hivemind's deadlines are computed (the constants above say why each is what it is)."""
    mm, avg = config.matchmaking_time, config.averaging_timeout
    matchmaking = MATCHMAKINGS_PER_ATTEMPT * mm
    attempt = matchmaking + avg + ATTEMPT_SLACK
    retries = avg + MATCHMAKINGS_PER_REDUCE * mm
    return Deadlines(
        presence=min(PRESENCE_LOOKUP, mm),
        matchmaking=matchmaking,
        attempt=attempt,
        retries=retries,
        own_timeout=retries + attempt,
    )

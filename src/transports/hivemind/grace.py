"""Quorum and grace window of hivemind rounds (``HivemindConfig.quorum``; docs/elastic.md).

With a quorum, a peer's matchmaking for a round lasts a grace window from its arrival instead of
``matchmaking_time``: hivemind's leader (the peer whose window ends first: the first to arrive) closes the
group once every expected peer has joined, or at the window's end with at least the quorum. Every groupmate
sends when it arrived with its matchmaking data, so every member computes the same arrival spread; the window
is ``SLACK_FACTOR`` times its median over the last full rounds (``transports.quorum.Grace``), at least
``MIN_WINDOW`` (peers find their leader through the DHT) and at most ``grace_seconds`` and
``matchmaking_time``. Until a full round was measured, a round waits for every expected peer, as without a
quorum, in windows of ``grace_seconds`` (hivemind's DHT keeps the latest expiration a peer declared: after one
of ``matchmaking_time``, shorter windows could not be declared until it had passed). Members' windows are then alike, so a late peer never outranks the group's leader.

A peer that arrives after its group closed finds that another peer has committed the round (their presence
records say so, ``Swarm.ahead``): it takes that round's result (the state the group committed from the state
it holds) instead of averaging alone, and goes on in phase; its own contribution is dropped and counted.
Peers on several machines compare arrivals on their own clocks: a skew between them widens the window (the
same for every member), within ``grace_seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..quorum import Grace, Quorum

__all__ = ["MIN_WINDOW", "RoundWindows", "Window"]

MIN_WINDOW = 1.0
"""Seconds: the shortest window, room for a peer that arrives to read the leader's declaration in the DHT and
be accepted (a chosen floor, not tuned: on 127.0.0.1 the fault benchmark's and the quorum test's full groups
formed well within it)."""


@dataclass(frozen=True, kw_only=True)
class Window:
    """How one attempt of a round matchmakes (``Averager.step``)."""

    seconds: float
    """From this peer's arrival until its group may close without the peers still expected."""
    quorum: int
    """The smallest group that may close then (fewer: matchmaking goes on, within ``matchmaking_time``)."""


class RoundWindows:
    """The grace window of each reduce key, from the arrival spread of its full rounds."""

    def __init__(self, *, quorum: Quorum, matchmaking_time: float) -> None:
        capped = Quorum(
            members=quorum.members, grace_seconds=min(quorum.grace_seconds, matchmaking_time)
        )
        self._grace = Grace(capped, floor=min(MIN_WINDOW, capped.grace_seconds))

    def window(self, key: str, *, target: int) -> Window:
        """The window of a round of ``key`` that expects ``target`` peers. Until a full round of it was measured
        (the first rounds: the peers' start-up spreads them), the bound, and only a full group may close."""
        if not self._grace.measured(key):
            return Window(seconds=self._grace.quorum.grace_seconds, quorum=target)
        return Window(
            seconds=self._grace.window(key), quorum=max(1, min(self._grace.quorum.members, target))
        )

    def committed(self, key: str, *, group: int, target: int, spread: float | None) -> None:
        """A round of ``key`` committed with ``group`` peers of the ``target`` expected, whose arrivals spread over
        ``spread`` seconds (None: unknown); a full round counts towards the window."""
        if group >= target and spread is not None:
            self._grace.full_round(key, max(0.0, spread))

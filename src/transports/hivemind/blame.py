"""Whose part exchange failed a round: the groupmates a peer's runner saw fail
(``reducer.Runner.blamed``: a reducer that answered with an error or not in time, a sender that sent
nothing in time or broke off), sent with its confirmation (``confirm``: its *report*), and the
group's verdict from the reports (``culprits``), carried to the transport typed
(``ExchangeFailed``).

Each groupmate's view alone may be wrong (on a loaded machine an honest peer's part can be late), so
a peer is to blame only if most groupmates that reported blame it: at least 2, and more than half of
the reports besides its own (for a member that owns no part, a client: the reports of the owners,
the only members it exchanges with; with one owner, its report alone). A report that blames every
other member (two at least) is void: it counts for nobody, its sender included. Everyone failing a
peer may be its own fault (the peer whose exchanges fail sees every groupmate fail), but a survivor
beside a groupmate that died, whose exchange with the other survivor failed in its wake (a loaded
machine), sees the same; the others' reports tell the two apart (they blame the failing peer, and
nobody blames the survivor), so the sender of a void report waits for every groupmate's report, not
only for those of the groupmates it did not see fail. (Convicting itself on its own view made such a
survivor sit out its next rounds, averaging alone: the survivors diverged.) In a group of two the
peers' views are alike (each saw the other fail): nobody is blamed and the round is retried as
before. Every groupmate waits for the reports of the groupmates it did not see fail (those it saw
fail may never answer, a dead peer's never comes), so the groupmates that matter reach the same
verdict.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from hivemind.averaging.allreduce import AllreduceException

__all__ = ["ExchangeFailed", "ShortRelay", "culprits", "read_report", "report"]


def report(peers: Sequence[Any], failed: Collection[Any]) -> bytes:
    """The report of a peer whose runner saw ``failed`` fail: their indices in the group, one byte
    each."""
    if len(peers) > 256:
        return b""  # not expressible in a byte: nobody blamed
    return bytes(i for i, p in enumerate(peers) if p in failed)


def read_report(payload: bytes, *, size: int, sender: int) -> frozenset[int]:
    """A groupmate's report as received (nothing received is trusted): the indices it blames, none
    if it is malformed (an index out of the group's ``size``, its own, or one twice)."""
    got = list(payload)
    if len(got) >= size or len(set(got)) != len(got) or any(i >= size or i == sender for i in got):
        return frozenset()
    return frozenset(got)


def culprits(
    size: int, reports: Mapping[int, Collection[int]], owners: Collection[int] | None = None
) -> frozenset[int]:
    """The members (indices) of a group of ``size`` to blame, from the ``reports`` received, by
    sender index (see the module docstring). ``owners``: the members that own parts (None: all).
    One that owns none (a client, ``reachability``) exchanges with the owners only, so only their
    reports judge it: with a single owner, that owner's report alone."""
    if size < 3:
        return frozenset()
    # everyone failed it: its own fault, or a groupmate died beside another (the others' reports say)
    void = {s for s, r in reports.items() if len(r) == size - 1}
    voters = {s: r for s, r in reports.items() if s not in void}
    owning = set(range(size)) if owners is None else set(owners)
    guilty: set[int] = set()
    for m in range(size):
        judges = (set(range(size)) if m in owning else owning) - {m}
        others = [r for s, r in voters.items() if s in judges]
        blamers = sum(m in r for r in others)
        if blamers >= min(2, len(judges)) and 2 * blamers > len(others):
            guilty.add(m)
    return frozenset(guilty)


class ShortRelay(AllreduceException):
    """A block codec's part owner relayed fewer payloads than the group has others: a sender failed
    the owner (its part never came), which is the sender's fault, not the relay's (not blamed)."""


class ExchangeFailed(AllreduceException):
    """A round's exchange failed and this peer holds ``culprits`` (peer ids, bytes) to blame: the
    transport retries without them (or, if this peer is the culprit, averages alone while benched:
    ``swarm.Swarm.bench``). Raised in the averager's process, it reaches the transport through
    hivemind's pipe, pickled: its ``args`` are (culprits, message), so that it unpickles as
    itself."""

    def __init__(self, culprits: tuple[bytes, ...], message: str) -> None:
        super().__init__(culprits, message)
        self.culprits, self.message = culprits, message

    def __str__(self) -> str:
        return self.message

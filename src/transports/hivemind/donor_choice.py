"""Which served state a peer takes (a joiner, or a peer behind its group), and from whom: never one
that a single donor claims alone beyond what the swarm shows.

A donor's claim is its state tag (rounds, hash chain). A tag is *credible* if its rounds are at most
one more than the swarm's (``swarm_round``: the most rounds that at least two peers' presence
records or offers show, one claim per peer, this peer's own included; or the rounds of the group
state this peer is catching up to, ``floor``), or if several donors serve that very tag (they
agree). A state with a tag that is not credible is refused, and its donor named. Among credible
states a peer takes the one that the most donors serve (by tag), then the one with the most rounds,
counted at most one beyond the swarm's (a donor's priority, capped), then the larger hash (the same
choice on every peer that sees the same offers).

What one insider can still do alone: serve a state at most one round beyond the swarm's (where no
other donor serves that round: a peer catching up, or a swarm of two), or forge presence records
under other peer ids (the run's records are MACed with a key every member holds). docs/wan.md, "A
peer that fell behind"."""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .state_tag import Tag, tag_or_none

__all__ = ["Choice", "Offer", "choose", "offer_of", "swarm_round"]


@dataclass(frozen=True)
class Offer:
    """What one donor says it serves (read before its state is downloaded)."""

    peer: bytes
    tag: Tag | None
    """None: it serves a state that tracks no rounds (broadcasts only)."""
    prev: Tag | None

    @property
    def rounds(self) -> int:
        return -1 if self.tag is None else self.tag[0]


def offer_of(peer: Any, meta: Any) -> Offer | None:
    """A donor's offer from the metadata it served (nothing received is trusted); None if it is
    malformed or not ready."""
    if not isinstance(peer, bytes) or not isinstance(meta, dict) or meta.get("ready") is not True:
        return None
    tag, prev = meta.get("tag"), meta.get("prev_tag")
    if any(t is not None and tag_or_none(t) is None for t in (tag, prev)):
        return None
    return Offer(peer=peer, tag=tag_or_none(tag), prev=tag_or_none(prev))


def swarm_round(claims: Iterable[int]) -> int | None:
    """The most rounds that at least two peers claim (the second-highest of one claim per peer); the
    only claim if there is one; None if none."""
    got = sorted(claims, reverse=True)
    return got[1] if len(got) >= 2 else (got[0] if got else None)


@dataclass(frozen=True)
class Choice:
    """The state to take (``donors``: who serve it, to try in turn; empty: none fits) and the donors
    refused."""

    tag: Tag | None
    donors: tuple[bytes, ...]
    refused: tuple[tuple[bytes, str], ...]
    """(donor, why): donors whose tag is not credible."""


def choose(
    offers: Iterable[Offer],
    *,
    claims: Mapping[bytes, int],
    floor: int | None = None,
    accept: Callable[[Offer], bool] = lambda o: True,
) -> Choice:
    """The state to take among ``offers``: credible (see the module), fitting ``accept``, the most
    donors first. ``claims``: per peer id, the rounds its presence record declares (this peer's own
    included); ``floor``: the rounds of the group state this peer is catching up to (the verdict of
    its group: credible whatever the swarm shows)."""
    offers = list({o.peer: o for o in offers}.values())  # one offer per donor
    per_peer = dict(claims)
    for o in offers:
        per_peer[o.peer] = max(per_peer.get(o.peer, -1), o.rounds)
    shown = swarm_round(per_peer.values())
    cap = max(x for x in (shown, floor, -1) if x is not None)
    by_tag: dict[Tag | None, list[Offer]] = {}
    for o in offers:
        by_tag.setdefault(o.tag, []).append(o)
    refused: list[tuple[bytes, str]] = []
    ranked = []
    for tag, group in by_tag.items():
        rounds = group[0].rounds
        if len(group) < 2 and rounds > cap + 1:
            why = f"it alone serves round {rounds}, the swarm shows round {cap}"
            refused += [(o.peer, why) for o in group]
            continue
        if accept(group[0]):
            hash_ = b"" if tag is None else tag[1]
            ranked.append(((len(group), min(rounds, cap + 1), hash_), tag, group))
    if not ranked:
        return Choice(tag=None, donors=(), refused=tuple(refused))
    _, tag, group = max(ranked, key=lambda r: r[0])
    return Choice(tag=tag, donors=tuple(o.peer for o in group), refused=tuple(refused))

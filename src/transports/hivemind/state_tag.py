"""The state tag: which committed rounds a peer's state is made of, compared by groupmates before averaging.

A tag is (rounds committed, hash chain of their results). Peers with equal tags applied the same results to
the same start state, so they hold the same global state (the outer step is deterministic); no pass over
the parameters is needed. Groupmates send their tags with matchmaking; if they differ nobody sends
anything and every groupmate reaches the same verdict (``stale_verdict``), raised as a typed
``StaleStateError`` in the averager's process and handled by the transport.
"""

import enum
import hashlib
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.averaging.allreduce import AllreduceException

from .blame import ExchangeFailed

TAG_BYTES = 16
Tag = tuple[int, bytes]
INITIAL_TAG: Tag = (0, bytes(TAG_BYTES))
"""The tag of a state that holds no committed round (no group holds it once it has averaged)."""


def next_tag(tag: Tag, result_digest: bytes) -> Tag:
    """The state tag after one more committed round, whose result has ``result_digest``."""
    count, chain = tag
    return count + 1, hashlib.sha256(chain + result_digest).digest()[:TAG_BYTES]


def valid_tag(tag: Any) -> bool:
    if not isinstance(tag, (list, tuple)) or len(tag) != 2:
        return False
    count, chain = tag
    return (
        isinstance(count, int)
        and count >= 0
        and isinstance(chain, bytes)
        and len(chain) == TAG_BYTES
    )


def tag_or_none(tag: Any) -> Tag | None:
    """A groupmate's state tag as it came with its matchmaking data (``auth.unwrap_gather``, checked);
    None if it sent none or a malformed one."""
    return (tag[0], tag[1]) if valid_tag(tag) else None


class Stale(enum.Enum):
    BEHIND = "behind"
    """This peer's state is not its group's (older, diverged or none): it takes the group's state."""
    GROUPMATE = "groupmate"
    """This peer holds its group's state and some groupmates do not, or no state is its group's (a
    tie that nothing settles): it retries without them."""


@dataclass(frozen=True)
class StaleVerdict:
    """Why a group did not average: its members' state tags differ."""

    kind: Stale
    group_tag: Tag
    """The group's state: the tag with the most holders. Holders first: a
    peer that committed rounds alone (cut off, or an insider left out of every group: benched, it
    averages its own scaled updates) is not the state a majority of its group takes. No tag with
    more holders than every other (a tie, as in any group of two): a claimed round count settles
    nothing (an insider claims any), so a peer takes the other's state only if it is exactly one
    round on from its own (a peer that fell behind by a round, or whose group averaged a round
    without it), or of its own round with a larger hash (two peers that each averaged a round
    alone: one history for both again), and otherwise keeps its own (``group_tag`` is then its own
    tag)."""
    own_tag: Tag | None
    """This peer's tag (None: it sent none)."""
    stale: int
    """Groupmates (this peer included) whose tag is not ``group_tag``."""
    doubtful: tuple[bytes, ...] = ()
    """Groupmates (peer ids, where the group's were given) whose tag is held by nobody else and
    claims more than one round beyond every other state in the group: not credible, retried without
    (``StaleStateError.culprits``)."""
    apart: tuple[bytes, ...] = ()
    """Groupmates (peer ids) that keep a state this peer does not take either (a tie that nothing
    settles): retried without too, so that the two do not meet again at every attempt."""

    def __str__(self) -> str:
        if self.doubtful:
            names = ", ".join(p.hex()[-8:] for p in self.doubtful)
            return f"peer(s) {names} claim a state over one round beyond the group's: not credible"
        if self.apart:
            names = ", ".join(p.hex()[-8:] for p in self.apart)
            return f"peer(s) {names} keep a state this peer does not take, nor they its own"
        if self.kind is Stale.GROUPMATE:
            return f"{self.stale} groupmate(s) hold an older or diverged state"
        mine = "no state" if self.own_tag is None else f"round {self.own_tag[0]}"
        return f"this peer's state ({mine}) differs from its group's (round {self.group_tag[0]})"


class StaleStateError(ExchangeFailed):
    """A group's state tags differ: nothing was sent. Raised in the averager's process, it reaches
    the transport through hivemind's pipe from that process, pickled: its ``args`` is the verdict
    alone, so that it unpickles as itself, verdict included (tests/test_hivemind.py checks the
    trip). An ``ExchangeFailed`` whose culprits are the groupmates whose tag is not credible
    (``StaleVerdict.doubtful``) or who keep a state apart (``apart``): the transport retries
    without them and names them (``swarm.Swarm.bench``)."""

    def __init__(self, verdict: StaleVerdict) -> None:
        AllreduceException.__init__(self, verdict)
        self.verdict, self.message = verdict, str(verdict)
        self.culprits = verdict.doubtful + verdict.apart

    def __str__(self) -> str:
        return str(self.verdict)


def _doubtful(tags: Sequence[Tag | None], counted: Sequence[int]) -> list[int]:
    """The groupmates (of ``counted``) whose tag nobody else holds and whose rounds exceed every
    other tag's by more than one (peers with no state, or the initial one, have no say)."""
    out = []
    for i in counted:
        t = tags[i]
        others = [tags[j][0] for j in counted if tags[j] not in (None, t, INITIAL_TAG)]
        alone = sum(tags[j] == t for j in counted) == 1
        if t is not None and others and alone and t[0] > max(others) + 1:
            out.append(i)
    return out


def _group_of(
    tags: Sequence[Tag | None], i: int, *, counted: Sequence[int], doubtful: Collection[int]
) -> tuple[Tag, bool]:
    """The state groupmate ``i`` takes for its group's (see ``StaleVerdict.group_tag``), and whether
    it takes it (it is behind)."""
    held = Counter(tags[k] for k in counted)
    if not held:
        return INITIAL_TAG, False
    top = max(held.values())
    tied = [t for t in held if held[t] == top]
    mine = tags[i]
    if len(tied) == 1:  # the most holders
        group = tied[0]
    elif mine is None:  # no state of its own: the one state not in doubt, if there is just one
        sure = [t for t in tied if all(tags[k] != t for k in doubtful)]
        group = sure[0] if len(sure) == 1 else INITIAL_TAG
    else:  # a tie: a state one round on from this peer's is taken if it is the only one; else,
        # among states of its own round, the larger hash (two peers each averaged a round alone)
        next_ = [t for t in tied if t[0] == mine[0] + 1]
        same = [t for t in tied if t[0] == mine[0]]
        group = next_[0] if len(next_) == 1 else max([mine, *same], key=lambda t: t[1])
    return group, group != mine and group in held


def stale_verdict(
    tags: Sequence[Tag | None],
    me: int,
    distrusted: Collection[int] = (),
    peers: Sequence[bytes] = (),
) -> StaleVerdict | None:
    """None if every groupmate holds the same state tag; otherwise the verdict for groupmate ``me``:
    ``me`` is behind (it must re-sync) or a groupmate is (see ``StaleVerdict.group_tag``).
    ``distrusted``: groupmates ``me`` benched (``strikes``): their tags count for nothing and they
    are stale whatever they hold, so ``me`` neither averages with them nor takes their state (they
    may reach another verdict: none sends). ``peers``: the group's peer ids, to name the groupmates
    to retry without (``doubtful`` and ``apart``)."""
    if not distrusted and all(t == tags[0] for t in tags):
        return None
    counted = [i for i, t in enumerate(tags) if t is not None and i not in distrusted]
    doubtful = _doubtful(tags, counted)
    group, behind = _group_of(tags, me, counted=counted, doubtful=doubtful)
    kind = Stale.BEHIND if behind else Stale.GROUPMATE
    stale = sum(t != group or i in distrusted for i, t in enumerate(tags))
    # Groupmates that keep a state of their own (they take neither this one nor another): with them
    # every attempt would end here again.
    others = [j for j in counted if j != me and tags[j] != group]
    apart = [j for j in others if not _group_of(tags, j, counted=counted, doubtful=doubtful)[1]]
    named = len(peers) == len(tags)
    return StaleVerdict(
        kind=kind,
        group_tag=group,
        own_tag=tags[me],
        stale=stale,
        doubtful=tuple(peers[i] for i in doubtful if i != me) if named else (),
        apart=tuple(peers[i] for i in apart if i not in doubtful) if named else (),
    )

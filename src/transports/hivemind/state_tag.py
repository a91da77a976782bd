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
    return isinstance(count, int) and count >= 0 and isinstance(chain, bytes) and len(chain) == TAG_BYTES


def tag_or_none(tag: Any) -> Tag | None:
    """A groupmate's state tag as it came with its matchmaking data (``auth.unwrap_gather``, checked);
    None if it sent none or a malformed one."""
    return (tag[0], tag[1]) if valid_tag(tag) else None


class Stale(enum.Enum):
    BEHIND = "behind"
    """This peer's state is not its group's (older, diverged or none): it takes the group's state."""
    GROUPMATE = "groupmate"
    """This peer holds its group's state and some groupmates do not: it retries without them."""


@dataclass(frozen=True)
class StaleVerdict:
    """Why a group did not average: its members' state tags differ."""

    kind: Stale
    group_tag: Tag
    """The group's state: the tag with the most holders, then the most rounds, then the larger hash. Holders
    first: a peer that committed rounds alone (cut off, or an insider left out of every group: benched, it
    averages its own scaled updates) is not the state a majority of its group takes."""
    own_tag: Tag | None
    """This peer's tag (None: it sent none)."""
    stale: int
    """Groupmates (this peer included) whose tag is not ``group_tag``."""

    def __str__(self) -> str:
        if self.kind is Stale.GROUPMATE:
            return f"{self.stale} groupmate(s) hold an older or diverged state"
        mine = "no state" if self.own_tag is None else f"round {self.own_tag[0]}"
        return f"this peer's state ({mine}) differs from its group's (round {self.group_tag[0]})"


class StaleStateError(AllreduceException):
    """A group's state tags differ: nothing was sent. Raised in the averager's process, it reaches the
    transport through hivemind's pipe from that process, pickled: its ``args`` is the verdict alone, so
    that it unpickles as itself, verdict included (tests/test_hivemind.py checks the trip)."""

    def __init__(self, verdict: StaleVerdict) -> None:
        super().__init__(verdict)
        self.verdict = verdict

    def __str__(self) -> str:
        return str(self.verdict)


def stale_verdict(tags: Sequence[Tag | None], me: int, distrusted: Collection[int] = ()) -> StaleVerdict | None:
    """None if every groupmate holds the same state tag; otherwise the verdict for groupmate ``me``, the
    same group state on every groupmate: ``me`` is behind (it must re-sync) or a groupmate is. ``distrusted``:
    groupmates ``me`` benched (``strikes``): their tags count for nothing and they are stale whatever they hold,
    so ``me`` neither averages with them nor takes their state (they may reach another verdict: none sends)."""
    if not distrusted and all(t == tags[0] for t in tags):
        return None
    held = Counter(t for i, t in enumerate(tags) if t is not None and i not in distrusted)
    group = max(held, key=lambda t: (held[t], t[0], t[1])) if held else INITIAL_TAG
    kind = Stale.GROUPMATE if tags[me] == group or not held else Stale.BEHIND
    stale = sum(t != group or i in distrusted for i, t in enumerate(tags))
    return StaleVerdict(kind=kind, group_tag=group, own_tag=tags[me], stale=stale)

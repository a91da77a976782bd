"""The state tag: which committed rounds a peer's state is made of, compared by groupmates before averaging.

A tag is (rounds committed, hash chain of their results). Peers with equal tags applied the same results to
the same start state, so they hold the same global state (the outer step is deterministic); no pass over
the parameters is needed. Groupmates send their tags with matchmaking; if they differ nobody sends
anything and every groupmate reaches the same verdict (``stale_verdict``).
"""

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

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


def tag_or_none(serializer: Any, gathered: bytes) -> Tag | None:
    """A groupmate's state tag from its matchmaking data (msgpack, checked); None if it sent none."""
    try:
        tag = serializer.loads(serializer.loads(gathered)[2])
    except Exception:  # noqa: BLE001 - malformed: treated as a peer with no (or a foreign) state
        return None
    return (tag[0], tag[1]) if valid_tag(tag) else None


def stale_verdict(tags: Sequence[Tag | None], me: int) -> str | None:
    """None if every groupmate holds the same state tag. Otherwise the group's state is the tag with the
    most rounds (then the most holders, then the larger hash: the same choice on every peer), and the
    message tells this peer whether it is behind (it must re-sync) or a groupmate is."""
    if all(t == tags[0] for t in tags):
        return None
    held = Counter(t for t in tags if t is not None)
    group = max(held, key=lambda t: (t[0], held[t], t[1]))
    if tags[me] == group:
        return f"[stale:groupmate] {sum(t != group for t in tags)} groupmate(s) hold an older or diverged state"
    mine = "no state" if tags[me] is None else f"round {tags[me][0]}"
    return (
        f"[stale:behind:{group[0]}:{group[1].hex()}] this peer's state ({mine}) differs from its group's "
        f"(round {group[0]})"
    )

"""The reduce number: which call of a key a peer's contribution belongs to, so that two calls never mix.

A reduce of an untracked key (the model's buffers, the warm start's gradients: no state tag to compare) used to
be met by whoever matchmade on that key. After a failed attempt, a peer's retry of call n could meet another
peer's call n + 1, and the two were averaged (a CI run saw round 1's mean come out 15.5 where 10.5 was due: one
peer's round-1 value with another's round-2 value). Now every reduce of an untracked key is numbered per averager
(peers meet per averager: key, size, wire and merge): (the rounds of the state this peer holds, the calls since
that state), so a joiner that took the swarm's state is in step at once. The number travels with matchmaking (``auth.wrap_gather``). Groupmates whose numbers differ send
nothing and all reach one verdict (``step_verdict``): the group's number is the one most of them hold, then the
highest (a peer that moved on has given up the call the others still retry). A peer behind it fails its call at
once and numbers its next call as the group's, which is still waiting for it; the others retry without it. Reduces of tracked keys (DiLoCo's
rounds) carry no number: their state tags, compared the same way, hold the round (``state_tag``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.averaging.allreduce import AllreduceException

__all__ = [
    "MAX_NUMBER",
    "Number",
    "OutOfStepError",
    "ReduceNumbers",
    "StepVerdict",
    "number_or_none",
    "step_verdict",
]

MAX_NUMBER = 2**62
"""Counts at or above this are malformed (a groupmate that sends one sent no number)."""

Number = tuple[int, int]
"""(rounds of the state this peer holds, calls of the key since it took that state)."""


def number_or_none(value: Any) -> Number | None:
    """A groupmate's reduce number as it came with matchmaking; None if it sent none or a malformed one."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_NUMBER for v in value)
    return (value[0], value[1]) if ok else None


@dataclass(frozen=True, kw_only=True)
class StepVerdict:
    """Why a group did not average: its members' reduce numbers differ."""

    group: Number
    """The group's number: the one most members hold, then the highest."""
    own: Number | None
    behind: bool
    """This peer's number is below the group's: its call can no longer complete; it numbers on from the group's."""
    apart: int
    """Members (this peer included) whose number is not the group's."""

    def __str__(self) -> str:
        if self.own == self.group:
            return f"{self.apart} groupmate(s) are at another call of this key than this peer's {self.group}"
        return f"this peer's call {self.own} of this key differs from its group's {self.group}"


class OutOfStepError(AllreduceException):
    """A group's reduce numbers differ: nothing was sent. Pickled through hivemind's pipe like
    ``state_tag.StaleStateError``: its ``args`` is the verdict alone."""

    def __init__(self, verdict: StepVerdict) -> None:
        super().__init__(verdict)
        self.verdict = verdict

    def __str__(self) -> str:
        return str(self.verdict)


def step_verdict(numbers: Sequence[Number | None], me: int) -> StepVerdict | None:
    """None if every groupmate sent the same number (or none sent one: a tracked key); otherwise the verdict for
    groupmate ``me``, built on the same group number by every member."""
    if all(n == numbers[0] for n in numbers):
        return None
    held = Counter(n for n in numbers if n is not None)
    if not held:
        return None
    group = max(held, key=lambda n: (held[n], n))
    own = numbers[me]
    apart = sum(n != group for n in numbers)
    return StepVerdict(group=group, own=own, behind=own is not None and own < group, apart=apart)


class ReduceNumbers:
    """This peer's next reduce number per key. Numbered as each reduce starts (they run one at a time, in call
    order), so a call that failed behind its group passes the group's number on to the next."""

    def __init__(self) -> None:
        self._next: dict[str, Number] = {}
        self._lock = threading.Lock()

    def take(self, key: str, *, rounds: int) -> Number:
        """The number of the reduce of ``key`` that starts now, on a state of ``rounds`` committed rounds."""
        with self._lock:
            held = self._next.get(key, (rounds, 0))
            number = held if held[0] == rounds else (rounds, 0)
            self._next[key] = (number[0], number[1] + 1)
            return number

    def catch_up(self, key: str, group: Number) -> None:
        """A reduce of ``key`` found its group at call ``group``: this peer's next call of ``key`` is numbered
        ``group``, to meet the group's call that is still waiting for it."""
        with self._lock:
            self._next[key] = max(self._next.get(key, group), group)

"""``InProcessGroup``: the ranks (threads) of an in-process transport, where their collectives meet.

The n-th call with a key on every rank meets in that key's n-th slot; an all-reduce's result is the ``Merge`` of
the contributions in rank order, computed once and handed to every rank. A rank that leaves: collectives complete
among the members that remain. With a ``Quorum``, a round may close without a late member (``quorum.py``): that
member's contribution is dropped and counted, and it receives the round's result when it comes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from diloco_core import MEAN, Codec, LeftOut, Merge
from diloco_core.transport import TransportError

from .payload_size import misfit
from .quorum import Grace, Quorum

if TYPE_CHECKING:
    from .inprocess import InProcessTransport

__all__ = ["InProcessGroup", "Slot"]


@dataclass
class Slot:
    """One collective: the n-th call with a key on every rank meets in that key's n-th slot."""

    kind: str
    key: str
    codec: Codec
    merge: Merge
    numels: list[int] = field(default_factory=list)
    """Values per tensor (a payload may hold another number of elements)."""
    contributions: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    result: list[torch.Tensor] | None = None
    num_contributors: int = 0
    left_out: tuple[LeftOut, ...] = ()
    error: str | None = None
    consumed: set[int] = field(default_factory=set)
    quorum_at: float | None = None
    """When it had its quorum (``time.monotonic()``), if the group has one."""
    absent: tuple[str, ...] = ()
    """The members it closed without (late or absent: their contributions, if they come, are dropped)."""
    grace_seconds: float = 0.0
    """What it waited, from its quorum until it closed."""


class InProcessGroup:
    def __init__(self, world_size: int, *, quorum: Quorum | None = None) -> None:
        """``quorum``: a round may close without its late members (None, or ``members`` 0: every member)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid: expected an integer >= 1")
        self.world_size = world_size
        self._grace = Grace(quorum) if quorum is not None and quorum.members else None
        self._cond = threading.Condition()
        self._members = set(range(world_size))
        self._issued: set[int] = set()
        self._next_op: dict[tuple[int, str], int] = {}
        self._slots: dict[tuple[str, int], Slot] = {}

    def transport(self, rank: int) -> InProcessTransport:
        """The transport of ``rank`` (once per rank)."""
        # the transport is built on the group: imported when first used
        from .inprocess import (
            InProcessTransport,
        )

        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank={rank!r} is invalid: expected an integer in [0, {self.world_size - 1}]"
            )
        with self._cond:
            if rank in self._issued:
                raise ValueError(f"rank {rank} of this InProcessGroup already has a transport")
            self._issued.add(rank)
        return InProcessTransport(self, rank)

    def closed_all(self) -> bool:
        """Every member has left."""
        with self._cond:
            return not self._members

    def num_members(self) -> int:
        """Members that have not left."""
        with self._cond:
            return len(self._members)

    def join(
        self,
        rank: int,
        *,
        kind: str,
        key: str,
        codec: Codec,
        tensors: list[torch.Tensor] | None,
        numels: list[int],
        merge: Merge = MEAN,
    ) -> tuple[tuple[str, int], Slot]:
        """``rank``'s next collective of ``key`` (its contribution, if any): the slot it meets the others in."""
        with self._cond:
            if rank not in self._members:
                raise TransportError(f"rank {rank} has left the in-process group")
            n = self._next_op.get((rank, key), 0)
            self._next_op[rank, key] = n + 1
            op = (key, n)
            slot = self._slots.setdefault(op, Slot(kind, key, codec, merge, numels))
            mine = (kind, codec.identity, merge)  # the codec's name, block and layout
            if (slot.kind, slot.codec.identity, slot.merge) != mine:
                slot.error = (
                    f"collective #{n} of key {key!r} mismatched: {slot.kind}/{slot.codec.identity}/{slot.merge} vs "
                    f"{kind}/{codec.identity}/{merge} on rank {rank}"
                )
            elif (
                slot.result is not None
            ):  # closed without this late member: its contribution is dropped
                pass
            elif tensors is not None:
                refused = _refused(slot, rank, codec=codec, tensors=tensors, numels=numels)
                if refused is not None and slot.error is None:
                    slot.error = f"collective #{n} of key {key!r}: {refused}"
                slot.contributions[rank] = tensors
                if (
                    self._grace
                    and slot.quorum_at is None
                    and len(slot.contributions) >= self._need()
                ):
                    slot.quorum_at = time.monotonic()
            self._complete(slot)
            self._cond.notify_all()
            return op, slot

    def await_mean(
        self, op: tuple[str, int], slot: Slot, *, rank: int, timeout: float
    ) -> list[torch.Tensor]:
        """The mean of ``op`` once every member contributed; ``TransportError`` if it failed or did not complete
        within ``timeout`` (then it fails for every rank). Consumed by ``rank`` if it failed."""
        with self._cond:
            ready = self._wait(slot, timeout)
            if not ready and slot.error is None:
                # Abandoned for every rank: a straggler that joins it late fails too, and its retry meets the
                # others' retry in the next slot, instead of pairing its round with the others' next one.
                missing = sorted(self._members - set(slot.contributions))
                key, n = op
                slot.error = f"in-process all_reduce #{n} of key {key!r}: ranks {missing} did not join within {timeout:g}s"
                self._cond.notify_all()
            if slot.error is not None:
                self._consume(op, slot, rank)
                raise TransportError(slot.error)
            assert slot.result is not None
            return slot.result

    def await_broadcast(
        self, op: tuple[str, int], slot: Slot, *, rank: int, src: int, timeout: float
    ) -> list[torch.Tensor]:
        """``src``'s values of broadcast ``op``; ``TransportError`` if ``src`` left first or did not send in time."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: (
                    src in slot.contributions or slot.error is not None or src not in self._members
                ),
                timeout,
            )
            if slot.error is not None:
                raise TransportError(slot.error)
            if src not in slot.contributions and src not in self._members:
                raise TransportError(
                    f"in-process broadcast #{op[1]}: rank {src} left the group before sending"
                )
            if not ready:
                raise TransportError(
                    f"in-process broadcast #{op[1]}: rank {src} did not send within {timeout:g}s"
                )
            return slot.contributions[src]

    def consume(self, op: tuple[str, int], slot: Slot, rank: int) -> None:
        """``rank`` is done with ``op``: the slot goes once every member is."""
        with self._cond:
            self._consume(op, slot, rank)

    def leave(self, rank: int) -> None:
        """``rank`` leaves: collectives complete among the members that remain."""
        with self._cond:
            self._members.discard(rank)
            for op, slot in list(self._slots.items()):
                self._complete(slot)
                if slot.kind == "broadcast" and slot.contributions and rank in slot.contributions:
                    continue  # a broadcast that rank already sent stays readable
                if self._members <= slot.consumed:
                    self._slots.pop(op, None)
            self._cond.notify_all()

    # Everything below runs with self._cond held.

    def _need(self) -> int:
        """Contributions a round needs to close without the others (the quorum, of the members that remain)."""
        assert self._grace is not None
        return min(self._grace.quorum.members, len(self._members))

    def _wait(self, slot: Slot, timeout: float) -> bool:
        """Wait for ``slot``'s result (True) or error, closing it once its quorum's grace window has passed;
        False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while slot.result is None and slot.error is None:
            now, until = time.monotonic(), deadline
            if self._grace is not None and slot.quorum_at is not None:
                closes = slot.quorum_at + self._grace.window(slot.key)
                if now >= closes:
                    self._complete(slot, force=True)
                    self._cond.notify_all()
                    continue
                until = min(until, closes)
            if now >= deadline:
                return False
            self._cond.wait(until - now)
        return True

    def _complete(self, slot: Slot, *, force: bool = False) -> None:
        """Merge ``slot`` once every member contributed (``force``: with those that did, its grace window over)."""
        if slot.kind != "all_reduce" or slot.result is not None or slot.error is not None:
            return
        if not force and not self._members <= set(slot.contributions):
            return
        if slot.quorum_at is not None:
            slot.grace_seconds = time.monotonic() - slot.quorum_at
            if not force and self._grace is not None:
                self._grace.full_round(slot.key, slot.grace_seconds)
        slot.absent = tuple(f"rank {r}" for r in sorted(self._members - set(slot.contributions)))
        ranks = sorted(slot.contributions)
        out = torch.empty(sum(slot.numels), dtype=torch.float32)
        payloads = [slot.contributions[r][0] for r in ranks]
        slot.left_out = slot.merge.of(
            payloads, codec=slot.codec, out=out, who=[f"rank {r}" for r in ranks]
        )
        slot.result = list(out.split(slot.numels))
        slot.num_contributors = len(ranks)
        slot.contributions.clear()

    def _consume(self, op: tuple[str, int], slot: Slot, rank: int) -> None:
        slot.consumed.add(rank)
        if self._members <= slot.consumed:
            self._slots.pop(op, None)


def _refused(
    slot: Slot, rank: int, *, codec: Codec, tensors: list[torch.Tensor], numels: list[int]
) -> str | None:
    """Why ``rank``'s contribution to ``slot`` is refused (None: it is not): values that differ from the
    other ranks'; a payload whose size is not what its codec gives for the values (``payload_size``);
    or a codec whose payloads are not the size of those of the codec the slot holds (the same identity,
    other settings: the rank that joined first's, also named)."""
    first = next(iter(slot.contributions), rank)
    if slot.numels != numels:
        return f"rank {rank} sent shapes that differ from the other ranks'"
    if slot.kind != "all_reduce":
        return None
    numel = sum(numels)
    wrong = misfit(tensors[0], codec=codec, numel=numel)
    if wrong is None and codec.payload_spec(numel) != slot.codec.payload_spec(numel):
        wrong = (
            f"{codec.payload_bytes(numel)} bytes, expected {slot.codec.payload_bytes(numel)} (rank "
            f"{first}'s {slot.codec.identity} payload of {numel} values: the same identity, other settings)"
        )
    return None if wrong is None else f"rank {rank}'s payload is refused: {wrong}"

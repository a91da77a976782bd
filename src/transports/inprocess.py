"""In-process transport: ranks are threads of one process sharing an ``InProcessGroup``.

It is the oracle the network transports are tested against: the mean of the contributions' codec
payloads in rank order (``Codec.mean_of``), or their ``Merge`` where one is given, computed once and handed to
every rank. Collectives meet by key: the n-th call with a key on every rank meets in the same slot. A rank that ``close()``s leaves
the group; collectives then complete among the members that remain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from diloco_core import FP32, MEAN, Codec, LeftOut, Merge
from diloco_core.codecs.names import check_codec
from diloco_core.config import check_fields, integer, string
from diloco_core.transport import Capabilities, ReduceHandle, ReduceResult, Transport, TransportError, reduce_inputs

__all__ = ["InProcessConfig", "InProcessGroup", "InProcessTransport"]


@dataclass(frozen=True, kw_only=True)
class InProcessConfig:
    world_size: int = field(default=1, metadata=integer(low=1))
    """Ranks (threads) in the group."""
    rank: int = field(default=0, metadata=integer(low=0, high=lambda c: c.world_size - 1))
    """This thread's rank, in [0, world_size)."""
    group: str = field(default="default", metadata=string(empty=False))
    """Name of the group: threads that name the same group meet in it."""

    def __post_init__(self) -> None:
        check_fields(self)


_named_groups: dict[str, InProcessGroup] = {}
_named_lock = threading.Lock()
_BROADCAST = "broadcast"  # the key broadcasts meet by (all_reduce keys are the callers')


@dataclass
class _Slot:
    """One collective: the n-th call with a key on every rank meets in that key's n-th slot."""

    kind: str
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


class InProcessGroup:
    def __init__(self, world_size: int) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid: expected an integer >= 1")
        self.world_size = world_size
        self._cond = threading.Condition()
        self._members = set(range(world_size))
        self._issued: set[int] = set()
        self._next_op: dict[tuple[int, str], int] = {}
        self._slots: dict[tuple[str, int], _Slot] = {}

    def transport(self, rank: int) -> InProcessTransport:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is invalid: expected an integer in [0, {self.world_size - 1}]")
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
    ) -> tuple[tuple[str, int], _Slot]:
        """``rank``'s next collective of ``key`` (its contribution, if any): the slot it meets the others in."""
        with self._cond:
            if rank not in self._members:
                raise TransportError(f"rank {rank} has left the in-process group")
            n = self._next_op.get((rank, key), 0)
            self._next_op[rank, key] = n + 1
            op = (key, n)
            slot = self._slots.setdefault(op, _Slot(kind, codec, merge, numels))
            mine = (kind, codec.identity, merge)  # the codec's name, block and layout
            if (slot.kind, slot.codec.identity, slot.merge) != mine:
                slot.error = (
                    f"collective #{n} of key {key!r} mismatched: {slot.kind}/{slot.codec.identity}/{slot.merge} vs "
                    f"{kind}/{codec.identity}/{merge} on rank {rank}"
                )
            elif tensors is not None:
                first = next(iter(slot.contributions.values()), tensors)
                if [t.shape for t in first] != [t.shape for t in tensors] or slot.numels != numels:
                    slot.error = (
                        f"collective #{n} of key {key!r}: rank {rank} sent shapes that differ from the other ranks'"
                    )
                slot.contributions[rank] = tensors
            self._complete(slot)
            self._cond.notify_all()
            return op, slot

    def await_mean(self, op: tuple[str, int], slot: _Slot, *, rank: int, timeout: float) -> list[torch.Tensor]:
        """The mean of ``op`` once every member contributed; ``TransportError`` if it failed or did not complete
        within ``timeout`` (then it fails for every rank). Consumed by ``rank`` if it failed."""
        with self._cond:
            ready = self._cond.wait_for(lambda: slot.result is not None or slot.error is not None, timeout)
            if not ready and slot.error is None:
                # Abandoned for every rank: a straggler that joins it late fails too, and its retry meets the
                # others' retry in the next slot, instead of pairing its round with the others' next one.
                missing = sorted(self._members - set(slot.contributions))
                key, n = op
                slot.error = (
                    f"in-process all_reduce #{n} of key {key!r}: ranks {missing} did not join within {timeout:g}s"
                )
                self._cond.notify_all()
            if slot.error is not None:
                self._consume(op, slot, rank)
                raise TransportError(slot.error)
            assert slot.result is not None
            return slot.result

    def await_broadcast(
        self, op: tuple[str, int], slot: _Slot, *, rank: int, src: int, timeout: float
    ) -> list[torch.Tensor]:
        """``src``'s values of broadcast ``op``; ``TransportError`` if ``src`` left first or did not send in time."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: src in slot.contributions or slot.error is not None or src not in self._members, timeout
            )
            if slot.error is not None:
                raise TransportError(slot.error)
            if src not in slot.contributions and src not in self._members:
                raise TransportError(f"in-process broadcast #{op[1]}: rank {src} left the group before sending")
            if not ready:
                raise TransportError(f"in-process broadcast #{op[1]}: rank {src} did not send within {timeout:g}s")
            return slot.contributions[src]

    def consume(self, op: tuple[str, int], slot: _Slot, rank: int) -> None:
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

    def _complete(self, slot: _Slot) -> None:
        if slot.kind != "all_reduce" or slot.result is not None or slot.error is not None:
            return
        if not self._members <= set(slot.contributions):
            return
        ranks = sorted(slot.contributions)
        out = torch.empty(sum(slot.numels), dtype=torch.float32)
        payloads = [slot.contributions[r][0] for r in ranks]
        slot.left_out = slot.merge.of(payloads, codec=slot.codec, out=out, who=[f"rank {r}" for r in ranks])
        slot.result = list(out.split(slot.numels))
        slot.num_contributors = len(ranks)
        slot.contributions.clear()

    def _consume(self, op: tuple[str, int], slot: _Slot, rank: int) -> None:
        slot.consumed.add(rank)
        if self._members <= slot.consumed:
            self._slots.pop(op, None)


class _Handle(ReduceHandle):
    def __init__(
        self,
        group: InProcessGroup,
        rank: int,
        *,
        op: tuple[str, int],
        slot: _Slot,
        tensors: list[torch.Tensor],
        start: float,
    ) -> None:
        self._group, self._rank, self._op, self._slot, self._tensors, self._start = (
            group,
            rank,
            op,
            slot,
            tensors,
            start,
        )

    def wait(self, timeout: float) -> ReduceResult:
        g, slot = self._group, self._slot
        result = g.await_mean(self._op, slot, rank=self._rank, timeout=timeout)
        torch._foreach_copy_(self._tensors, [r.view_as(t) for r, t in zip(result, self._tensors)])
        g.consume(self._op, slot, self._rank)
        sent = slot.codec.payload_bytes(sum(slot.numels))
        took = time.perf_counter() - self._start
        return ReduceResult(slot.num_contributors, sent, sum(slot.numels) * 4, took, left_out=slot.left_out)


class InProcessTransport(Transport):
    capabilities = Capabilities(survives_leavers=True, keys_in_any_order=True)

    @classmethod
    def from_config(cls, config: InProcessConfig) -> InProcessTransport:
        """The transport of ``config.rank`` in the group named ``config.group`` (made by its first caller)."""
        with _named_lock:
            group = _named_groups.get(config.group)
            if group is None or group.closed_all():
                group = _named_groups[config.group] = InProcessGroup(config.world_size)
            elif group.world_size != config.world_size:
                raise ValueError(
                    f"world_size={config.world_size} is invalid: in-process group {config.group!r} has {group.world_size}"
                )
        return group.transport(config.rank)

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self._group = group
        self._rank = rank
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.num_members()

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, codec: Codec = FP32, key: str = "default", merge: Merge = MEAN
    ) -> ReduceHandle:
        start = time.perf_counter()
        tensors = reduce_inputs(tensors)
        check_codec(codec)
        # The tensors travel as one payload of their concatenation (a block codec's blocks run across them);
        # an fp32 payload of one tensor is its values, read in place (the caller waits first).
        flat = tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
        payload = [codec.encode(flat)]
        numels = [t.numel() for t in tensors]
        op, slot = self._group.join(
            self._rank, kind="all_reduce", key=key, codec=codec, tensors=payload, numels=numels, merge=merge
        )
        return _Handle(self._group, self._rank, op=op, slot=slot, tensors=tensors, start=start)

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        g = self._group
        if not 0 <= src < g.world_size:
            raise ValueError(f"src={src!r} is invalid: expected a rank in [0, {g.world_size - 1}]")
        tensors = list(tensors)
        payload = [t.detach().clone() for t in tensors] if src == self._rank else None
        op, slot = g.join(self._rank, kind="broadcast", key=_BROADCAST, codec=FP32, tensors=payload, numels=[])
        if src == self._rank:
            g.consume(op, slot, self._rank)
            return
        values = g.await_broadcast(op, slot, rank=self._rank, src=src, timeout=timeout)
        if [t.shape for t in values] != [t.shape for t in tensors]:
            raise TransportError(
                f"in-process broadcast #{op[1]}: rank {src} sent shapes that differ from rank {self._rank}'s"
            )
        torch._foreach_copy_(tensors, values)
        g.consume(op, slot, self._rank)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._group.leave(self._rank)

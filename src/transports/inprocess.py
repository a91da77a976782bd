"""In-process transport: ranks are threads of one process sharing an ``InProcessGroup`` (``inprocess_group``).

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

from diloco_core import FP32, MEAN, Codec, Merge
from diloco_core.codecs.names import check_codec
from diloco_core.rules import check_fields, integer, number, string
from diloco_core.transport import (
    Capabilities,
    ReduceHandle,
    ReduceResult,
    Transport,
    TransportError,
    reduce_inputs,
)

from .inprocess_group import InProcessGroup, Slot
from .quorum import Quorum

__all__ = ["InProcessConfig", "InProcessGroup", "InProcessTransport"]


@dataclass(frozen=True, kw_only=True)
class InProcessConfig:
    world_size: int = field(default=1, metadata=integer(low=1))
    """Ranks (threads) in the group."""
    rank: int = field(default=0, metadata=integer(low=0, high=lambda c: c.world_size - 1))
    """This thread's rank, in [0, world_size)."""
    group: str = field(default="default", metadata=string(empty=False))
    """Name of the group: threads that name the same group meet in it."""
    quorum: int = field(default=0, metadata=integer(low=0))
    """Contributions a round needs to close without late members after a grace window (``transports.quorum``);
    0: every member."""
    grace_seconds: float = field(
        default=5.0, metadata=number(gt=0, noun="a finite number of seconds")
    )
    """The longest grace window a round that has its quorum waits for the others (adaptive below it)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def quorum_rule(self) -> Quorum:
        return Quorum(members=self.quorum, grace_seconds=self.grace_seconds)


_named_groups: dict[str, InProcessGroup] = {}
_named_lock = threading.Lock()
_BROADCAST = "broadcast"  # the key broadcasts meet by (all_reduce keys are the callers')


class _Handle(ReduceHandle):
    def __init__(
        self,
        group: InProcessGroup,
        rank: int,
        *,
        op: tuple[str, int],
        slot: Slot,
        tensors: list[torch.Tensor],
        start: float,
    ) -> None:
        self._group = group
        self._rank = rank
        self._op = op
        self._slot = slot
        self._tensors = tensors
        self._start = start

    def wait(self, timeout: float) -> ReduceResult:
        g, slot = self._group, self._slot
        result = g.await_mean(self._op, slot, rank=self._rank, timeout=timeout)
        torch._foreach_copy_(self._tensors, [r.view_as(t) for r, t in zip(result, self._tensors)])
        g.consume(self._op, slot, self._rank)
        sent = slot.codec.payload_bytes(sum(slot.numels))
        took = time.perf_counter() - self._start
        return ReduceResult(
            slot.num_contributors,
            sent,
            sum(slot.numels) * 4,
            took,
            left_out=slot.left_out,
            absent=slot.absent,
            grace_seconds=slot.grace_seconds,
        )


class InProcessTransport(Transport):
    capabilities = Capabilities(survives_leavers=True, keys_in_any_order=True)

    @classmethod
    def from_config(cls, config: InProcessConfig) -> InProcessTransport:
        """The transport of ``config.rank`` in the group named ``config.group`` (made by its first caller)."""
        with _named_lock:
            group = _named_groups.get(config.group)
            if group is None or group.closed_all():
                group = _named_groups[config.group] = InProcessGroup(
                    config.world_size, quorum=config.quorum_rule
                )
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
        self,
        tensors: Sequence[torch.Tensor],
        *,
        codec: Codec = FP32,
        key: str = "default",
        merge: Merge = MEAN,
    ) -> ReduceHandle:
        start = time.perf_counter()
        tensors = reduce_inputs(tensors)
        check_codec(codec)
        # The tensors travel as one payload of their concatenation (a block codec's blocks run across them);
        # an fp32 payload of one tensor is its values, read in place (the caller waits first).
        flat = (
            tensors[0].reshape(-1)
            if len(tensors) == 1
            else torch.cat([t.reshape(-1) for t in tensors])
        )
        payload = [codec.encode(flat)]
        numels = [t.numel() for t in tensors]
        op, slot = self._group.join(
            self._rank,
            kind="all_reduce",
            key=key,
            codec=codec,
            tensors=payload,
            numels=numels,
            merge=merge,
        )
        return _Handle(self._group, self._rank, op=op, slot=slot, tensors=tensors, start=start)

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        g = self._group
        if not 0 <= src < g.world_size:
            raise ValueError(f"src={src!r} is invalid: expected a rank in [0, {g.world_size - 1}]")
        tensors = list(tensors)
        payload = [t.detach().clone() for t in tensors] if src == self._rank else None
        op, slot = g.join(
            self._rank, kind="broadcast", key=_BROADCAST, codec=FP32, tensors=payload, numels=[]
        )
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

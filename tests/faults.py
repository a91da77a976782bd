"""``FaultyTransport``: crash, delay or error a given rank's n-th reduce of a key, on any transport."""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco_core import (
    FP32,
    MEAN,
    Codec,
    Merge,
    ReduceHandle,
    ReduceResult,
    Transport,
    TransportError,
)
from transports import ForwardingTransport


class Phase(enum.Enum):
    START = "start"
    """When the reduce is started (``all_reduce``): nothing of this rank's reaches the others."""
    WAIT = "wait"
    """When its result is awaited (``wait``): this rank's contribution has been sent."""


class Action(enum.Enum):
    ERROR = "error"
    """This rank's call raises ``TransportError`` (at START: it never contributes)."""
    DELAY = "delay"
    """This rank sleeps ``seconds`` first (a straggler)."""
    CRASH = "crash"
    """This rank leaves the group (``close()``) and raises ``TransportError``, as a crashed process would."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    rank: int
    round: int
    """The n-th reduce of ``key`` on that rank (1 for the first)."""
    phase: Phase
    action: Action
    seconds: float = 0.0
    key: str = "default"


class _Handle(ReduceHandle):
    def __init__(self, inner: ReduceHandle, fault: Fault, transport: FaultyTransport) -> None:
        self._inner, self._fault, self._transport = inner, fault, transport

    def wait(self, timeout: float) -> ReduceResult:
        self._transport.act(self._fault)
        return self._inner.wait(timeout)


class FaultyTransport(ForwardingTransport):
    def __init__(self, inner: Transport, faults: Sequence[Fault]) -> None:
        super().__init__(inner)
        self.faults = list(faults)
        self.calls: Counter[str] = Counter()

    def act(self, fault: Fault) -> None:
        if fault.action is Action.DELAY:
            time.sleep(fault.seconds)
            return
        if fault.action is Action.CRASH:
            self.inner.close()
        raise TransportError(f"injected {fault.action.value} at {fault.phase.value} of {fault.key!r} #{fault.round}")

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, codec: Codec = FP32, key: str = "default", merge: Merge = MEAN
    ) -> ReduceHandle:
        self.calls[key] += 1
        n = self.calls[key]
        fault = next((f for f in self.faults if (f.rank, f.round, f.key) == (self.inner.rank, n, key)), None)
        if fault is not None and fault.phase is Phase.START:
            self.act(fault)
        handle = self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge)
        return handle if fault is None or fault.phase is Phase.START else _Handle(handle, fault, self)

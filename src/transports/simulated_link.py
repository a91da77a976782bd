"""A transport behind a simulated network link: each reduce completes no earlier than a link of a given
bandwidth and latency would deliver it, while the real (inner) transport moves the data.

The link is this member's, and serial: a reduce starts on it at its ``all_reduce`` call, or when the reduces
started before it have left the link, and occupies it for ``latency + bytes / (bandwidth / 8)`` seconds, where
bytes is the larger of what the inner reduce sent and received (a full-duplex link). The simulated clock runs
from the call, so a caller that computes meanwhile pays only what is left of it when it waits. A reduce's
bytes are known once its inner reduce has finished, so ``wait`` first finishes the inner reduces started
before it (in call order; every transport but the in-process one requires that order anyway).

``[transport] link_mbit`` and ``link_latency_ms`` put any transport behind such a link (``transports.factory``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_core import FP32, MEAN, Codec, Merge
from diloco_core.rules import check_field, check_fields, from_mapping, is_finite_number, number
from diloco_core.transport import ReduceHandle, ReduceResult, Transport, TransportError

from .forwarding import ForwardingTransport

__all__ = ["LINK_KEYS", "LinkConfig", "SimulatedLink", "link_from_section"]


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """The ``[transport]`` keys of a simulated link (unset: no simulated link)."""

    link_mbit: float | None = field(
        default=None,
        metadata=number(gt=0, noun="a finite number", unset=True, valid="a finite number > 0"),
    )
    """Bandwidth of each member's link in Mbit/s (10^6 bits per second), a finite number > 0."""
    link_latency_ms: float = field(default=0.0, metadata=number(ge=0, noun="a finite number"))
    """One-way latency added to every reduce, in milliseconds: a finite number >= 0 (needs ``link_mbit``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.link_mbit is None and self.link_latency_ms:
            raise ValueError(
                f"link_latency_ms={self.link_latency_ms!r} needs link_mbit (the link's bandwidth in Mbit/s)"
            )


LINK_KEYS = frozenset(f.name for f in LinkConfig.__dataclass_fields__.values())
"""The keys a ``[transport]`` section may hold for any kind."""


def link_from_section(section: Mapping[str, Any]) -> tuple[LinkConfig | None, dict[str, Any]]:
    """Split a ``[transport]`` section into its simulated link (None where ``link_mbit`` is unset) and the
    keys of its kind."""
    rest = {k: v for k, v in section.items() if k not in LINK_KEYS}
    config = from_mapping(
        LinkConfig, {k: v for k, v in section.items() if k in LINK_KEYS}, "transport"
    )
    return (config if config.link_mbit is not None else None), rest


class SimulatedLink(ForwardingTransport):
    """``inner`` behind a serial link of ``bandwidth`` bits/s and ``latency`` seconds per reduce.

    ``clock`` and ``sleep`` (seconds, monotonic) are the seams tests replace; a reduce's handle waits on the link
    through ``settle``, ``clock`` and ``sleep``."""

    def __init__(
        self,
        inner: Transport,
        *,
        bandwidth: float,
        latency: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        check_field(
            "bandwidth",
            bandwidth,
            is_finite_number(bandwidth) and bandwidth > 0,
            "a finite number of bits/s > 0",
        )
        check_field(
            "latency",
            latency,
            is_finite_number(latency) and latency >= 0,
            "a finite number of seconds >= 0",
        )
        super().__init__(inner)
        self.bandwidth, self.latency = float(bandwidth), float(latency)
        self.clock, self.sleep = clock, sleep
        """The link's time (seconds, monotonic) and how it waits: the seams tests replace."""
        self._lock = threading.Lock()
        self._queue: list[_LinkHandle] = []
        """Reduces started on the link whose bytes are not yet known, in call order."""
        self._free_at = 0.0
        """When the link has delivered every reduce whose bytes are known."""

    @classmethod
    def from_config(cls, inner: Transport, config: LinkConfig) -> SimulatedLink:
        assert config.link_mbit is not None
        return cls(inner, bandwidth=config.link_mbit * 1e6, latency=config.link_latency_ms / 1e3)

    def duration(self, nbytes: int) -> float:
        """Seconds the link takes to deliver ``nbytes`` once it is free."""
        return self.latency + nbytes * 8 / self.bandwidth

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        codec: Codec = FP32,
        key: str = "default",
        merge: Merge = MEAN,
    ) -> ReduceHandle:
        start = self.clock()
        handle = _LinkHandle(
            self, self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge), start
        )
        with self._lock:
            self._queue.append(handle)
        return handle

    def settle(self, upto: _LinkHandle, deadline: float) -> None:
        """Finish the inner reduces queued up to ``upto`` (in call order), placing each on the link."""
        while True:
            with self._lock:
                if upto.done_at is not None or not self._queue:
                    return
                head = self._queue[0]
            # one waiter at a time per handle; a handle's own lock orders the rest
            head.resolve(deadline)
            with self._lock:
                if self._queue and self._queue[0] is head:
                    self._queue.pop(0)
                    if head.result is not None:
                        nbytes = max(head.result.bytes_sent, head.result.bytes_received)
                        head.done_at = max(head.start, self._free_at) + self.duration(nbytes)
                        self._free_at = head.done_at
                    else:  # the inner reduce failed: it never reached the link
                        head.done_at = head.start


class _LinkHandle(ReduceHandle):
    def __init__(self, link: SimulatedLink, inner: ReduceHandle, start: float) -> None:
        self.link = link
        self.inner = inner
        self.start = start
        self.result: ReduceResult | None = None
        self.error: TransportError | None = None
        self.done_at: float | None = None
        self._resolving = threading.Lock()

    def resolve(self, deadline: float) -> None:
        """Wait for the inner reduce (at most until ``deadline``), once; its outcome is kept."""
        with self._resolving:
            if self.result is not None or self.error is not None:
                return
            try:
                self.result = self.inner.wait(max(deadline - self.link.clock(), 0.0))
            except TransportError as e:
                self.error = e

    def wait(self, timeout: float) -> ReduceResult:
        link = self.link
        deadline = link.clock() + timeout
        link.settle(self, deadline)
        if self.error is not None:
            raise self.error
        assert self.result is not None and self.done_at is not None
        if self.done_at > deadline:
            raise TransportError(
                f"the simulated link delivers this reduce {self.done_at - self.start:.3g}s after it started, "
                f"past the {timeout:g}s timeout"
            )
        left = self.done_at - link.clock()
        if left > 0:
            link.sleep(left)
        r = self.result
        return dataclasses.replace(r, seconds=max(self.done_at - self.start, r.seconds))

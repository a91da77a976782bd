"""A run's wall time predicted from its step time, its bytes per sync and the link: the model behind
``diloco plan``, and the one ``bench/time_to_loss.py`` checks against measured runs.

The model, per worker (every worker alike):

- a step computes for ``step_s`` seconds (forward, backward, optimizer: measured, not modelled);
- a sync moves ``bytes_out`` bytes out of each worker over the link in ``n x latency + bytes x 8 /
  rate`` seconds, its bytes and its ``n`` one-way latencies as the transport carries it (``routes``:
  the torch transport's paths and gloo's rings, hivemind's round phases; DDP: a ring, 2(W - 1)); a
  ``shared`` link (one queue for every worker, as the benchmark's ``tc`` loopback is) carries every
  worker's bytes in turn; a token-bucket link (``tc tbf``'s ``burst``) lets up to ``burst_bytes``
  through at once after the compute before the sync refilled them;
- what the link time is hidden behind: nothing for DDP's gradients and blocking rounds; the next ``H`` steps
  for eager rounds; ``overlap_steps`` steps for each streaming fragment. A step waits for the rest.

Not modelled: the round's own arithmetic outside the reduce (pseudo-gradient, encode and decode,
outer step: ``bench/time_to_loss.py`` adds what each blocking round measured; ``diloco plan`` takes
it as part of the step time it is given), stragglers, TCP's ramp-up and flow-control windows beyond
the first, and the warm start (DDP steps: ``ddp_seconds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco_core import Codec, MergeRule

from .routes import route

__all__ = [
    "MODES",
    "Link",
    "Method",
    "Row",
    "ddp_seconds",
    "exposed",
    "plan",
    "seconds_per_round",
    "sync_bytes",
]

MODES = ("blocking", "streaming", "eager")


@dataclass(frozen=True)
class Link:
    """Each worker's link: ``mbit`` (10^6 bit/s; 0: no limit), the one-way ``latency_ms`` from one
    worker to another, whether every worker's traffic shares it (``shared``) or each worker has its
    own full-duplex link, and a token bucket's depth (``burst_bytes``: tc tbf's ``burst``; 0 for a
    plain link)."""

    mbit: float
    latency_ms: float = 0.0
    shared: bool = False
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.mbit >= 0:
            raise ValueError(
                f"link mbit={self.mbit!r} is invalid: expected a rate >= 0 (0: no limit)"
            )
        if not self.latency_ms >= 0:
            raise ValueError(f"link latency_ms={self.latency_ms!r} is invalid: expected >= 0")
        if not self.burst_bytes >= 0:
            raise ValueError(f"link burst_bytes={self.burst_bytes!r} is invalid: expected >= 0")

    def seconds(
        self, nbytes: float, *, workers: int, idle_s: float = 0.0, latencies: int = 1
    ) -> float:
        """Seconds until a sync that sends ``nbytes`` out of each of ``workers`` workers and waits
        for ``latencies`` one-way latencies is through, the link idle for ``idle_s`` before it (a
        token bucket refills meanwhile, up to ``burst_bytes``)."""
        waits = latencies * self.latency_ms / 1e3
        if not self.mbit:
            return waits
        rate = self.mbit * 1e6 / 8  # bytes per second
        on_link = max(
            0.0, nbytes * (workers if self.shared else 1) - min(self.burst_bytes, idle_s * rate)
        )
        return waits + on_link / rate


@dataclass(frozen=True)
class Method:
    """How a run syncs: ``mode`` one of MODES, every ``inner_steps`` steps; streaming in ``fragments`` syncs
    of a fragment each, each hidden behind ``overlap_steps`` steps."""

    mode: str
    inner_steps: int
    fragments: int = 1
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is invalid: expected one of {list(MODES)}")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps={self.inner_steps!r} is invalid: expected >= 1")
        if not 1 <= self.fragments <= self.inner_steps:
            raise ValueError(
                f"fragments={self.fragments!r} is invalid: expected in [1, inner_steps={self.inner_steps}]"
            )
        if not 0 <= self.overlap_steps < self.inner_steps:
            raise ValueError(
                f"overlap_steps={self.overlap_steps!r} is invalid: expected in [0, inner_steps - 1={self.inner_steps - 1}]"
            )

    def steps_between_syncs(self) -> int:
        """Steps of compute before each sync (the link idle meanwhile): a round's, or a fragment's share."""
        return self.inner_steps // self.fragments if self.mode == "streaming" else self.inner_steps

    def hidden_steps(self) -> int:
        """Steps a sync's link time can hide behind: a streaming fragment's at most the steps until the next
        fragment's sync (one link carries them one after another)."""
        if self.mode == "streaming":
            return min(self.overlap_steps, self.inner_steps // self.fragments)
        return self.inner_steps if self.mode == "eager" else 0


def sync_bytes(
    params: int, codec: str | Codec, *, workers: int, rule: MergeRule = MergeRule.ROBUST
) -> int:
    """Bytes each worker sends to reduce ``params`` values on ``codec`` (the torch transport's
    paths: ``routes``)."""
    return route(params, codec, transport="torch", workers=workers, rule=rule).bytes_out


def exposed(link_s: float, *, hidden_s: float) -> float:
    """What a step waits of a sync whose link time is ``link_s``, hidden behind ``hidden_s`` of compute."""
    return max(0.0, link_s - hidden_s)


def seconds_per_round(
    *,
    step_s: float,
    round_bytes: float,
    link: Link,
    workers: int,
    method: Method,
    latencies: int = 1,
) -> float:
    """Wall seconds of one round of ``method.inner_steps`` steps whose syncs send ``round_bytes``
    per worker, each waiting for ``latencies`` one-way latencies."""
    syncs = method.fragments if method.mode == "streaming" else 1
    idle_s = method.steps_between_syncs() * step_s
    link_s = link.seconds(round_bytes / syncs, workers=workers, idle_s=idle_s, latencies=latencies)
    return method.inner_steps * step_s + syncs * exposed(
        link_s, hidden_s=method.hidden_steps() * step_s
    )


def ddp_seconds(*, step_s: float, grad_bytes: float, link: Link, workers: int) -> float:
    """Wall seconds of one DDP step (its gradient reduce, a ring, after the backward, nothing
    hidden)."""
    ring = 2 * (workers - 1)
    return step_s + link.seconds(grad_bytes, workers=workers, idle_s=step_s, latencies=ring)


@dataclass(frozen=True)
class Row:
    """One mode at one H; ``utilization`` and ``seconds_per_1000`` are NaN where the trainer refuses the setting
    (streaming with ``overlap_steps >= H``)."""

    inner_steps: int
    mode: str
    utilization: float
    seconds_per_1000: float


def plan(
    *,
    params: int,
    step_s: float,
    link: Link,
    workers: int,
    codec: str | Codec,
    inner_steps: tuple[int, ...],
    fragments: int,
    overlap_steps: int,
    transport: str = "torch",
    clients: int = 0,
) -> list[Row]:
    """Utilization and seconds per 1,000 steps of each mode at each H on ``transport``, ``clients``
    of the workers behind NAT (``routes``)."""
    for name, value, ok, valid in (
        ("params", params, params >= 1, ">= 1"),
        ("step_s", step_s, step_s > 0, "> 0"),
        ("workers", workers, workers >= 2, ">= 2"),
    ):
        if not ok:
            raise ValueError(f"{name}={value!r} is invalid: expected {valid}")
    sync = route(params, codec, transport=transport, workers=workers, clients=clients)
    rows = []
    for h in inner_steps:
        for mode in MODES:
            if mode == "streaming" and overlap_steps >= h:
                rows.append(
                    Row(inner_steps=h, mode=mode, utilization=math.nan, seconds_per_1000=math.nan)
                )
                continue
            streaming = mode == "streaming"
            method = Method(
                mode=mode,
                inner_steps=h,
                fragments=min(fragments, h) if streaming else 1,  # a round has at most H fragments
                overlap_steps=overlap_steps if streaming else 0,
            )
            per_round = seconds_per_round(
                step_s=step_s,
                round_bytes=sync.bytes_out,
                link=link,
                workers=workers,
                method=method,
                latencies=sync.latencies,
            )
            rows.append(
                Row(
                    inner_steps=h,
                    mode=mode,
                    utilization=h * step_s / per_round,
                    seconds_per_1000=1000 * per_round / h,
                )
            )
    return rows

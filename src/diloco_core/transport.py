"""The contract between the DiLoCo core and a network: asynchronous mean and broadcast (``membership``: what
transports whose peers come and go add)."""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codecs.base import FP32, Codec
from .merge import MEAN, LeftOut, Merge

__all__ = [
    "Capabilities",
    "FutureHandle",
    "ReduceHandle",
    "ReduceResult",
    "StateReplaced",
    "Transport",
    "TransportError",
    "check_own_timeout",
    "reduce_inputs",
]


class TransportError(RuntimeError):
    """A collective failed or did not finish in time. Raised within a bounded time, never a hang."""


class StateReplaced(TransportError):
    """The worker's state was stale or had diverged from its group's, and the transport replaced it with
    the group's (global params, outer state, round) instead of averaging: this round's contribution is
    dropped and training continues from the replaced state."""


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a transport does where transports legitimately differ (the defaults: a fixed group)."""

    fixed_ranks: bool = True
    """``rank`` and ``world_size`` hold for the whole run (in-process, torch.distributed), so ranks can
    agree on a resume step and check the world size. False where peers come and go (hivemind): a
    round's group is whoever shows up, and a peer alone averages alone (1 contributor, no error)."""
    survives_leavers: bool = False
    """A member that leaves (``close()`` or a crash) does not fail the others' collectives: they finish
    among the members that remain, with fewer contributors. False: they fail with ``TransportError``
    within their timeout."""
    exact_mean: bool = True
    """The result is ``reference_mean`` of the contributions (for fp32 and more than 2 members, up to
    fp32 summation order). False (hivemind): the mean is rounded to the codec once more on its way
    back, within half a unit of the wire format's last place."""
    broadcast_from_any_rank: bool = True
    """``broadcast`` takes any ``src``. False (hivemind): only ``src=0``, meaning whoever holds the
    run's state."""
    keys_in_any_order: bool = False
    """Reduces with different keys may be started in a different order on each member (in-process).
    False (torch.distributed, hivemind): every member starts and waits for them in the same order."""


@dataclass(frozen=True)
class ReduceResult:
    num_contributors: int
    """Peers whose values are in the mean (the divisor)."""
    bytes_sent: int
    bytes_received: int
    seconds: float
    """Wall time from the start of the collective until its result was in place."""
    left_out: tuple[LeftOut, ...] = ()
    """Contributions the merge left out (``Merge``), as far as this member saw: every one where a member merges
    every payload (in-process, torch on its gather path), those of the parts it merged where members merge parts."""
    absent: tuple[str, ...] = ()
    """Members the round closed without (a quorum and grace window: late, stalled or gone; as the transport names
    them). A late member's own result names it too: its contribution was dropped, it takes the round's result."""
    grace_seconds: float = 0.0
    """Seconds the round waited, once it had its quorum, for the members still to come."""


class ReduceHandle(ABC):
    @abstractmethod
    def wait(self, timeout: float) -> ReduceResult:
        """Block until the result is in place; raise ``TransportError`` after ``timeout`` seconds."""

    def completed(self) -> ReduceResult | None:
        """The result if the mean is in place already, without waiting; else None (also where unknown).
        Another thread may call it: a transport whose peers come and go serves completed means to joiners."""
        return None


class FutureHandle(ReduceHandle):
    """A handle over a ``concurrent.futures.Future`` that resolves to a ``ReduceResult``."""

    def __init__(self, future: concurrent.futures.Future, what: str) -> None:
        self._future = future
        self._what = what

    def wait(self, timeout: float) -> ReduceResult:
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TransportError(f"{self._what} did not finish within {timeout:g}s") from None
        except TransportError:
            raise
        except Exception as e:  # a backend error surfaces as the transport's typed error
            raise TransportError(f"{self._what} failed: {type(e).__name__}: {e}") from e

    def completed(self) -> ReduceResult | None:
        f = self._future
        return f.result() if f.done() and not f.cancelled() and f.exception() is None else None


class Transport(ABC):
    """A member of a group of workers that can average tensors.

    ``all_reduce`` returns at once; until its handle's ``wait`` returns, the caller must not touch the
    tensors. On success they hold the fp32 mean over the contributors that actually took part (see
    ``diloco_core.reference_mean``): the core never divides by a world size it remembered.

    Every reduce carries a ``key``: the n-th reduce with a key on one member meets the n-th reduce with
    that key on the others, and a transport keeps its buffers (hivemind: its averagers) per key, so
    reduces with different keys (the fragments of a streamed round) may be in flight at once. Members
    start and wait for keyed reduces in the same order (torch.distributed matches collectives by order).
    """

    own_timeout: float | None = None
    """Seconds after which the transport itself fails a collective that has not finished (torch: its
    process group's timeout; hivemind: the attempts of one round), or None where only the caller's
    ``wait(timeout)`` bounds it. ``DiLoCo`` refuses a ``reduce_timeout`` shorter than this: the core
    must not give up on a reduce that the transport is still running (docs/architecture.md, timeouts)."""

    capabilities: Capabilities = Capabilities()
    """Where this transport legitimately departs from the strictest contract (the contract suite and
    the core read it instead of asking which transport this is)."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Members the transport currently knows of (contributors to a given reduce may be fewer)."""

    @abstractmethod
    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, codec: Codec = FP32, key: str = "default", merge: Merge = MEAN
    ) -> ReduceHandle:
        """Start averaging the fp32 ``tensors`` in place across the group, each contribution (the tensors'
        concatenation) travelling as ``codec``'s payload (the transport moves payloads; the codec encodes and
        decodes them), merged by ``merge`` wherever the transport holds the received payloads (every member
        passes the same)."""

    @abstractmethod
    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        """Overwrite ``tensors`` on every member with ``src``'s values (exact, any dtype)."""

    def close(self) -> None:
        """Leave the group and release resources. Idempotent."""

    def __enter__(self) -> Transport:  # noqa: PYI034 - typing.Self is 3.11+; the core imports stdlib and torch only
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reduce_inputs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``all_reduce``'s input check, shared by every transport: at least one tensor, every one fp32 (a
    ``ValueError`` naming the dtype otherwise). Returns the tensors as a list."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("all_reduce needs at least one tensor")
    for t in tensors:
        if t.dtype != torch.float32:
            raise ValueError(f"all_reduce takes fp32 tensors, got {t.dtype}")
    return tensors


def check_own_timeout(transport: Transport, reduce_timeout: float) -> None:
    """The core may not give up on a reduce before the transport's own timeout would."""
    own = transport.own_timeout
    if own is not None and own > reduce_timeout:
        raise ValueError(
            f"reduce_timeout={reduce_timeout:g} is shorter than the transport's own timeout ({own:g}s): "
            f"the core would give up on reduces the transport still runs; set reduce_timeout >= {own:g} "
            "or lower the transport's timeout"
        )

"""A reduce in flight on the torch transport: its identity header checked first, then its buckets driven."""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diloco_core.transport import ReduceHandle, ReduceResult, TransportError

from .torch_identity import Identity

__all__ = ["TorchReduce", "transport_error"]


class TorchReduce(ReduceHandle):
    """Checks the reduce's identity header (``torch_identity``), then drives the reduce bucket by bucket.
    Each bucket is a generator that yields the works it needs finished before its next piece of fp32
    arithmetic, so later buckets stay on the wire meanwhile. Any failure leaves the group unusable."""

    def __init__(
        self,
        start_buckets: Callable[[], list[Iterator[list]]],
        *,
        header: tuple[Any, torch.Tensor, Callable[[torch.Tensor], None]],
        tensors: list[torch.Tensor],
        flat: torch.Tensor,
        n: int,
        sent: int,
        start: float,
        release: Callable[[], None],
        identity: Identity,
    ) -> None:
        self._start_buckets, self._header, self._tensors, self._flat = start_buckets, header, tensors, flat
        self._n, self._sent, self._start, self._release, self._identity = n, sent, start, release, identity

    def wait(self, timeout: float) -> ReduceResult:
        try:
            return self._finish(timeout)
        except TransportError as e:
            if self._identity.broken is None:
                self._identity.broken = f"a reduce failed ({e})"
            raise
        finally:
            self._release()  # the key's cached buffers are free for its next reduce

    def _finish(self, timeout: float) -> ReduceResult:
        deadline = time.monotonic() + timeout
        try:
            work, gathered, check = self._header
            if not work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))):
                raise TransportError(
                    f"torch.distributed all_reduce did not start within {timeout:g}s (no peer's header)"
                )
            check(gathered)
            for bucket in [_started(b) for b in self._start_buckets()]:  # every bucket's first collective, now
                for works in bucket:
                    for w in works:
                        left = deadline - time.monotonic()
                        if left <= 0 or not w.wait(timeout=datetime.timedelta(seconds=left)):
                            raise TransportError(f"torch.distributed all_reduce did not finish within {timeout:g}s")
        except TransportError:
            raise
        except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError
            raise transport_error("all_reduce", e, timeout, deadline) from e
        if self._flat.data_ptr() != self._tensors[0].data_ptr() or len(self._tensors) > 1:
            _unflatten(self._flat, self._tensors)
        return ReduceResult(self._n, self._sent, self._sent, time.perf_counter() - self._start)


def transport_error(what: str, e: RuntimeError, timeout: float, deadline: float) -> TransportError:
    if time.monotonic() >= deadline - 0.01 or "timed out" in str(e).lower():
        return TransportError(f"torch.distributed {what} did not finish within {timeout:g}s: {e}")
    return TransportError(f"torch.distributed {what} failed (a peer died or left?): {e}")


def _started(bucket: Iterator[list]) -> Iterator[list]:
    return itertools.chain([next(bucket)], bucket)


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    torch._foreach_copy_(tensors, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors)])

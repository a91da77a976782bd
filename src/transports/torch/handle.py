"""A reduce on the torch transport: a job of its communication thread (``worker``) that checks the
reduce's identity header (``identity``), then drives its buckets and puts the result in place; the
handle's ``wait`` only waits for that job."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diloco_core.merge import LeftOut, combined
from diloco_core.transport import ReduceHandle, ReduceResult, TransportError

from .comm_thread import Job, on_stream
from .identity import Identity

__all__ = ["TorchReduce", "finish", "transport_error"]

_NOUN = {"all_reduce": "a reduce", "broadcast": "a broadcast"}


class TorchReduce(ReduceHandle):
    """The job (``run``): the header's all-gather, then every bucket's first collective at once, each bucket a
    generator that yields the works it needs finished before its next piece of fp32 arithmetic, so later
    buckets stay on the wire meanwhile; then the result copied into the caller's tensors. Any failure
    leaves the group unusable."""

    def __init__(
        self,
        start_buckets: Callable[[], list[Iterator[list]]],
        *,
        start_header: Callable[[], tuple[Any, torch.Tensor]],
        check_header: Callable[[torch.Tensor], None],
        tensors: list[torch.Tensor],
        flat: torch.Tensor,
        n: int,
        sent: int,
        start: float,
        left_out: list[LeftOut],
        release: Callable[[], None],
        identity: Identity,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._start_buckets = start_buckets
        self._start_header = start_header
        self._check_header = check_header
        self._tensors = tensors
        self._flat = flat
        self._n = n
        self._sent = sent
        self._start = start
        self._release = release
        self._identity = identity
        self._stream = stream
        self._left_out = left_out  # filled by the buckets' merges as they run
        self.job = Job(self._run)

    def wait(self, timeout: float) -> ReduceResult:
        return finish(self.job, timeout, what="all_reduce", identity=self._identity)

    def _run(self, job: Job) -> ReduceResult:
        try:
            job.check()  # cancelled while queued (the transport closed)
            self._identity.check_usable()  # an earlier job failed: issue nothing
            with on_stream(self._stream):
                job.stage = "header"
                work, gathered = self._start_header()
                job.await_work(work)
                self._check_header(gathered)
                job.stage = "payload"
                for bucket in [
                    _started(b) for b in self._start_buckets()
                ]:  # every bucket's first collective
                    for works in bucket:
                        for w in works:
                            job.await_work(w)
                if self._flat.data_ptr() != self._tensors[0].data_ptr() or len(self._tensors) > 1:
                    _unflatten(self._flat, self._tensors)
            took = time.perf_counter() - self._start
            return ReduceResult(
                self._n, self._sent, self._sent, took, left_out=combined(self._left_out)
            )
        except TransportError as e:
            self._mark_broken(e)
            raise
        except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError
            error = transport_error("all_reduce", e)
            self._mark_broken(error)
            raise error from e
        finally:
            self._release()  # the key's cached buffers are free for its next reduce

    def _mark_broken(self, e: TransportError) -> None:
        if self._identity.broken is None:
            self._identity.broken = f"a reduce failed ({e})"


def finish(job: Job, timeout: float, *, what: str, identity: Identity) -> Any:
    """Wait up to ``timeout`` seconds for ``job`` and return its value. A job that did not finish is cancelled
    and leaves the group unusable: its collectives may still be posted here or on other ranks."""
    if not job.done.wait(timeout):
        if job.stage == "header":
            error = TransportError(
                f"torch.distributed {what} did not start within {timeout:g}s (no peer's header)"
            )
        elif job.stage == "queued":
            error = TransportError(
                f"torch.distributed {what} did not start within {timeout:g}s (an earlier collective still running)"
            )
        else:
            error = TransportError(f"torch.distributed {what} did not finish within {timeout:g}s")
        if identity.broken is None:
            identity.broken = f"{_NOUN[what]} failed ({error})"
        job.cancel(f"torch.distributed {what} was given up ({error})")
        raise error
    return job.outcome()


def transport_error(what: str, e: RuntimeError) -> TransportError:
    if "timed out" in str(e).lower():
        return TransportError(
            f"torch.distributed {what} did not finish within the process group's timeout: {e}"
        )
    return TransportError(f"torch.distributed {what} failed (a peer died or left?): {e}")


def _started(bucket: Iterator[list]) -> Iterator[list]:
    return itertools.chain([next(bucket)], bucket)


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    torch._foreach_copy_(
        tensors, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    )

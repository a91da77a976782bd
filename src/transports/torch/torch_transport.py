"""LAN transport over torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors.

The fp32 codec travels as bucketed ring all-reduces (torch's own), each bucket divided by the group
size while the next is still on the wire. Any other codec must cut bytes *and* keep fp32 sums, which
a 16-bit all-reduce does not (gloo sums fp16 in fp16, and on CPU it is no faster). So that path moves
the codec's payloads with point-to-point sends and has the codec decode them into fp32 sums, in rank
order, which makes the result bit-identical on every rank and equal to
``diloco_core.reference_mean``:

- every rank sends its payload to every peer and sums all W in fp32 ((W-1)·P payload bytes out per
  rank; fp16 at W=2: half the bytes of an fp32 ring), while that sends no more than the path below
  (``wire_bytes.path_of``: fp16 and bf16 up to 3 ranks, int8 4, the narrower wires 8);
- beyond: reduce-scatter of shard payloads (all-to-all; each shard encoded on its own), fp32 sums
  per shard, then the fp32 shards are all-gathered ((W-1)/W·(P + 4N) bytes out per rank; fp16 at 4
  ranks: 25% under an fp32 ring).

Buckets and shards start at multiples of the codec's ``block`` (int8/int4: values per scale), so each
piece encodes exactly as its part of the whole contribution: the mean is the reference mean, and a
contributor's own ``decode(encode(x))`` is what its peers decoded (error feedback relies on it).

Buffers are kept per reduce key; reduces with different keys may be in flight at once, started and
waited for in the same order on every rank. A reduce runs in the transport's communication thread
(``worker``), in the background from ``all_reduce`` on: it first exchanges an identity header, its
payload starts once every rank's header matched, and its result is in the caller's tensors when the job
ends; ``wait()`` only waits for that. Broadcasts go through the same thread, so collectives keep the order
of the calls. A failed reduce leaves the group unusable (``identity``). While a reduce is in flight,
nothing else may issue collectives on the same process group from another thread (give DDP or other
users their own group).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from diloco_core import FP32, MEAN, Codec, LeftOut, Merge
from diloco_core.codecs.names import check_codec
from diloco_core.transport import ReduceHandle, Transport, TransportError, reduce_inputs

from .buffers import Buffers
from .comm_thread import CommThread, Job, on_stream
from .group import BACKEND_DEVICE, TorchDistConfig, init_process_group
from .handle import TorchReduce, finish, transport_error
from .identity import Identity
from .membership_proof import membership_key, prove_membership
from .reduce_paths import ReducePaths
from .wire_bytes import Path, bytes_out, path_of

__all__ = ["TorchDistConfig", "TorchDistTransport"]

# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning in every process) for all_gather_single
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

logger = logging.getLogger(__name__)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


class TorchDistTransport(Transport):
    """A member of a torch.distributed process group (the default one unless ``group`` is given)."""

    @classmethod
    def from_config(cls, config: TorchDistConfig) -> TorchDistTransport:
        # before joining: a bad secret_file fails before any rank waits on this one
        key = membership_key(config)
        created = not dist.is_initialized()
        if created:
            init_process_group(config)
        try:
            # every rank holds the run's secret, before any collective
            prove_membership(key, timeout=config.timeout)
        except BaseException:
            if created:
                dist.destroy_process_group()
            raise
        # It made the default group, so it destroys it: a group left to the interpreter's exit
        # sometimes aborted the process there ("terminate called without an active exception").
        return cls(
            bucket_mb=config.bucket_mb,
            timeout=config.timeout,
            narrow=config.narrow,
            owns_group=created,
        )

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_mb: float = 8.0,
        timeout: float | None = None,
        narrow: Path | None = None,
        owns_group: bool = False,
    ) -> None:
        """``timeout``: the process group's own, if known (``from_config`` knows it), for ``own_timeout``;
        ``narrow``: the path of every codec but fp32 (``TorchDistConfig.path``), None: the fewest bytes;
        ``owns_group``: the default group is this transport's (made by ``from_config``), destroyed by ``close``."""
        if not dist.is_initialized():
            raise ValueError(
                "TorchDistTransport needs an initialized process group (dist.init_process_group)"
            )
        self._group = group
        self._backend = str(dist.get_backend(group))
        if self._backend not in BACKEND_DEVICE:
            raise ValueError(
                f"process group backend {self._backend!r} is not supported: expected gloo or nccl"
            )
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._paths = ReducePaths(group, rank=self._rank, size=self._size)
        self._bucket_numel = max(1, int(bucket_mb * 1e6 / 4))
        self._narrow = narrow
        self._closed = False
        self._owns_group = owns_group
        self._buffers: dict[str, Buffers] = {}  # per reduce key
        self._identity = Identity()
        # every collective, in call order
        self._comm = CommThread(f"diloco-torch-comm-{self._rank}")
        # a transport dropped without close() stops its thread too
        weakref.finalize(self, self._comm.close)
        self.own_timeout = timeout

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def _check(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = list(tensors)
        if self._closed:
            raise TransportError("transport is closed")
        self._identity.check_usable()
        want = BACKEND_DEVICE[self._backend]
        for t in tensors:
            if t.device.type != want:
                raise ValueError(
                    f"backend {self._backend!r} reduces {want} tensors, got one on {t.device}"
                    + (
                        ' (set [diloco] global_device = "cuda")'
                        if want == "cuda"
                        else " (use backend='nccl')"
                    )
                )
        return tensors

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        codec: Codec = FP32,
        key: str = "default",
        merge: Merge = MEAN,
    ) -> ReduceHandle:
        start = time.perf_counter()
        tensors = self._check(reduce_inputs(tensors))
        check_codec(codec)
        flat = _flatten(tensors)
        cached = self._buffers.get(key)
        if cached is None or cached.device != flat.device:
            cached = self._buffers[key] = Buffers(flat.device)
        # same key still in flight: fresh ones
        buffers = Buffers(flat.device) if cached.busy else cached
        w = self._size
        left_out: list[LeftOut] = []  # what the merges of this rank's buckets or shards left out
        path = path_of(codec, rule=merge.rule, world_size=w, narrow=self._narrow)  # ``wire_bytes``
        if path is Path.RING:
            # a backend's sum: no payload seen, nothing to judge (fewer than 3: no majority)
            bucket_fn = self._paths.ring
        else:
            paths = self._paths
            gather = paths.gather_all if path is Path.GATHER else paths.scatter_gather
            bucket_fn = functools.partial(gather, codec=codec, merge=merge, left_out=left_out)
        size = max(codec.block, self._bucket_numel // codec.block * codec.block)
        parts = flat.split(size)
        # the payload bytes (the header's 40 B aside); each peer's share goes in the header (``identity``)
        sent = sum(bytes_out(b.numel(), codec, path=path, world_size=w) for b in parts)
        each = sent // max(1, w - 1)
        header = self._identity.header(key, codec, flat.numel(), flat.device, path=path, each=each)
        gathered = torch.empty(w * header.numel(), dtype=header.dtype, device=header.device)
        buffers.busy = True
        # Each hand-off to the communication thread is a named function (docs/architecture.md, "To Merge.of").
        handle = TorchReduce(
            functools.partial(_start_buckets, bucket_fn, parts, buffers=buffers, size=size),
            start_header=functools.partial(self._start_header, gathered, header),
            check_header=functools.partial(self._identity.check, rank=self._rank),
            identity=self._identity,
            tensors=tensors,
            flat=flat,
            n=w,
            sent=sent,
            start=start,
            left_out=left_out,
            release=buffers.release,
            stream=_caller_stream(flat),
        )
        try:
            self._comm.submit(handle.job)
        except TransportError:
            buffers.busy = False
            raise
        return handle

    def _start_header(
        self, gathered: torch.Tensor, header: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        """On the communication thread: every rank's identity header, gathered (the work and its buffer)."""
        return _ALL_GATHER(gathered, header, group=self._group, async_op=True), gathered

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        tensors = self._check(tensors)
        if not 0 <= src < self._size:
            raise ValueError(f"src={src!r} is invalid: expected a rank in [0, {self._size - 1}]")
        stream = _caller_stream(tensors[0]) if tensors else None

        def run(job: Job) -> None:
            job.check()  # cancelled while queued (the transport closed)
            self._identity.check_usable()  # an earlier job failed: issue nothing
            job.stage = "payload"
            try:
                with on_stream(stream):
                    works = [
                        dist.broadcast(
                            t, self._paths.global_rank(src), group=self._group, async_op=True
                        )
                        for t in tensors
                    ]
                    for work in works:
                        job.await_work(work)
            except TransportError as e:
                self._identity.broken = self._identity.broken or f"a broadcast failed ({e})"
                raise
            except RuntimeError as e:
                error = transport_error("broadcast", e)
                self._identity.broken = self._identity.broken or f"a broadcast failed ({error})"
                raise error from e

        job = Job(run)
        self._comm.submit(job)
        finish(job, timeout, what="broadcast", identity=self._identity)

    def close(self) -> None:
        """Mark the transport closed and stop its communication thread (a reduce in flight is cancelled). The
        default group ``from_config`` made is destroyed once that thread has stopped; a group given to the
        constructor stays its creator's to destroy."""
        self._closed = True
        self._comm.close()
        if self._owns_group and self._comm.stopped() and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def _caller_stream(t: torch.Tensor) -> torch.cuda.Stream | None:
    """The calling thread's current stream on ``t``'s GPU, for the job's kernels and collectives."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else None


def _start_buckets(
    bucket_fn: Callable[..., Iterator[list]],
    parts: Sequence[torch.Tensor],
    *,
    buffers: Buffers,
    size: int,
) -> list[Iterator[list]]:
    """On the communication thread: each bucket's reduce (``ReducePaths``' ``ring``, ``gather_all`` or ``scatter_gather``:
    the last two merge with ``Merge.of``), as a generator of the works it waits for."""
    return [bucket_fn(b, buffers=buffers, index=i, start=i * size) for i, b in enumerate(parts)]

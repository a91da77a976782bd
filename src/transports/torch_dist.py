"""LAN transport over torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors.

fp32 travels as bucketed ring all-reduces (torch's own), each bucket divided by the group size while
the next is still on the wire. A 16-bit wire dtype must cut bytes *and* keep fp32 sums, which a
16-bit all-reduce does not (gloo sums fp16 in fp16, and on CPU it is no faster). So the 16-bit path
moves payloads with point-to-point sends and does the sums itself, in fp32 and in rank order, which
makes the result bit-identical on every rank and equal to ``diloco_core.wire.reference_mean``:

- up to 3 ranks: every rank sends its wire payload to every peer and sums all W in fp32
  ((W-1)·N wire values out per rank; at W=2 half the bytes of an fp32 ring);
- 4 or more: reduce-scatter of wire-dtype shards (all-to-all), fp32 sums per shard, then the fp32
  shards are all-gathered ((W-1)/W·N·(2+4) bytes out per rank, 25% under an fp32 ring).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diloco_core.config import check_field, is_finite_number
from diloco_core.transport import ReduceHandle, ReduceResult, Transport, TransportError
from diloco_core.wire import WIRE_DTYPES, reference_mean, wire_torch_dtype

__all__ = ["TorchDistConfig", "TorchDistTransport"]

logger = logging.getLogger(__name__)

_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


@dataclass(frozen=True, kw_only=True)
class TorchDistConfig:
    backend: str = "gloo"
    """gloo for CPU tensors, nccl for CUDA tensors (then set the core's global_device to "cuda")."""
    init_method: str = "env://"
    """Where ranks meet when no process group exists yet; env:// reads torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT."""
    timeout: float = 600.0
    """Seconds any collective may take before the process group fails it (a dead peer's bound)."""
    bucket_mb: float = 8.0
    """Size of the buckets a reduce is split into, in MB of fp32: few large collectives, pipelined."""

    def __post_init__(self) -> None:
        check_field("backend", self.backend, self.backend in _BACKEND_DEVICE, f"one of {sorted(_BACKEND_DEVICE)}")
        check_field("init_method", self.init_method, isinstance(self.init_method, str), "a URL such as env://")
        check_field("timeout", self.timeout, is_finite_number(self.timeout) and self.timeout > 0, "a number of seconds > 0")
        check_field("bucket_mb", self.bucket_mb, is_finite_number(self.bucket_mb) and self.bucket_mb > 0, "a number of MB > 0")


def _init_from_env(config: TorchDistConfig) -> None:
    if config.init_method == "env://":
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(
                f"transport kind 'torch' needs a process group: launch with torchrun (it sets {missing}) "
                "or set [transport] init_method"
            )
    if config.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False; use backend='gloo'")
    timeout = datetime.timedelta(seconds=config.timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if config.init_method == "env://" and attempt is not None:
        # After torchrun restarts the workers (--max-restarts) they meet in the same store as before,
        # where the killed group's keys still stand: gloo then dials the dead workers' addresses
        # ("Connection refused") or waits for them. Each attempt gets keys of its own.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
            is_master=rank == 0 and not agent_store, timeout=timeout,
        )  # fmt: skip
        prefixed = dist.PrefixStore(f"diloco/attempt_{attempt}", store)
        dist.init_process_group(config.backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(config.backend, init_method=config.init_method, timeout=timeout)


class _Handle(ReduceHandle):
    """Drives the reduce bucket by bucket. Each bucket is a generator that yields the works it needs
    finished before its next piece of fp32 arithmetic, so later buckets stay on the wire meanwhile."""

    def __init__(self, buckets: list[Iterator[list]], tensors: list[torch.Tensor], flat: torch.Tensor,
                 n: int, sent: int, start: float, owner: "TorchDistTransport | None") -> None:  # fmt: skip
        self._buckets, self._tensors, self._flat = buckets, tensors, flat
        self._n, self._sent, self._start, self._owner = n, sent, start, owner

    def wait(self, timeout: float) -> ReduceResult:
        try:
            return self._finish(timeout)
        finally:
            if self._owner is not None:  # this reduce held the transport's cached buffers
                self._owner._busy = False

    def _finish(self, timeout: float) -> ReduceResult:
        deadline = time.monotonic() + timeout
        try:
            for bucket in self._buckets:
                for works in bucket:
                    for w in works:
                        left = deadline - time.monotonic()
                        if left <= 0 or not w.wait(timeout=datetime.timedelta(seconds=left)):
                            raise TransportError(f"torch.distributed all_reduce did not finish within {timeout:g}s")
        except TransportError:
            raise
        except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError
            raise _transport_error("all_reduce", e, timeout, deadline) from e
        if self._flat.data_ptr() != self._tensors[0].data_ptr() or len(self._tensors) > 1:
            _unflatten(self._flat, self._tensors)
        return ReduceResult(self._n, self._sent, self._sent, time.perf_counter() - self._start)


def _transport_error(what: str, e: RuntimeError, timeout: float, deadline: float) -> TransportError:
    if time.monotonic() >= deadline - 0.01 or "timed out" in str(e).lower():
        return TransportError(f"torch.distributed {what} did not finish within {timeout:g}s: {e}")
    return TransportError(f"torch.distributed {what} failed (a peer died or left?): {e}")


def _wire_name(dtype: torch.dtype) -> str:
    return next(name for name, d in WIRE_DTYPES.items() if d == dtype)


def _started(bucket: Iterator[list]) -> Iterator[list]:
    return itertools.chain([next(bucket)], bucket)


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    torch._foreach_copy_(tensors, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


class TorchDistTransport(Transport):
    """A member of a torch.distributed process group (the default one unless ``group`` is given)."""

    @classmethod
    def from_config(cls, config: TorchDistConfig) -> "TorchDistTransport":
        if not dist.is_initialized():
            _init_from_env(config)
        return cls(bucket_mb=config.bucket_mb)

    def __init__(self, group: dist.ProcessGroup | None = None, *, bucket_mb: float = 8.0) -> None:
        if not dist.is_initialized():
            raise ValueError("TorchDistTransport needs an initialized process group (dist.init_process_group)")
        self._group = group
        self._backend = str(dist.get_backend(group))
        if self._backend not in _BACKEND_DEVICE:
            raise ValueError(f"process group backend {self._backend!r} is not supported: expected gloo or nccl")
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._bucket_numel = max(1, int(bucket_mb * 1e6 / 4))
        self._closed = False
        # Scratch buffers kept from round to round: a fresh 100 MB buffer costs more in page faults
        # than the arithmetic done in it. Only one reduce at a time uses them (_busy).
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._busy = False

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
        want = _BACKEND_DEVICE[self._backend]
        for t in tensors:
            if t.device.type != want:
                raise ValueError(
                    f"backend {self._backend!r} reduces {want} tensors, got one on {t.device}"
                    + (" (set [diloco] global_device = \"cuda\")" if want == "cuda" else " (use backend='nccl')")
                )
        return tensors

    def _buffer(self, key: tuple, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._busy:  # another reduce is still in flight and owns the cached buffers
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self._group is None else dist.get_global_rank(self._group, group_rank)

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, wire_dtype: str = "fp32") -> ReduceHandle:
        start = time.perf_counter()
        dtype = wire_torch_dtype(wire_dtype)
        tensors = self._check(tensors)
        for t in tensors:
            if t.dtype != torch.float32:
                raise ValueError(f"all_reduce takes fp32 tensors, got {t.dtype}")
        flat = _flatten(tensors)
        w, n = self._size, flat.numel()
        buckets = list(flat.split(self._bucket_numel))
        if dtype == torch.float32:
            bucket_fn, sent = self._ring, 2 * (w - 1) * n * 4 // w
        elif w <= 3:
            bucket_fn, sent = self._gather_all, (w - 1) * n * dtype.itemsize
        else:
            bucket_fn, sent = self._scatter_gather, (w - 1) * n * (dtype.itemsize + 4) // w
        cached = not self._busy
        try:
            # Start every bucket's first collective now; wait() finishes them in order.
            buckets = [_started(bucket_fn(b, dtype, i)) for i, b in enumerate(flat.split(self._bucket_numel))]
        except RuntimeError as e:
            raise TransportError(f"torch.distributed all_reduce failed to start: {e}") from e
        self._busy = True
        return _Handle(buckets, tensors, flat, w, sent, start, self if cached else None)

    def _ring(self, bucket: torch.Tensor, dtype: torch.dtype, index: int) -> Iterator[list]:
        yield [dist.all_reduce(bucket, group=self._group, async_op=True)]
        bucket.div_(self._size)

    def _exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> list:
        # One batch: NCCL would deadlock on unbatched sends that both peers post before their receives.
        ops = [dist.P2POp(dist.isend, t, self._global_rank(r), self._group) for r, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, self._global_rank(r), self._group) for r, t in recvs.items()]
        return dist.batch_isend_irecv(ops)

    def _gather_all(self, bucket: torch.Tensor, dtype: torch.dtype, index: int) -> Iterator[list]:
        me, peers, n, dev = self._rank, [r for r in range(self._size) if r != self._rank], bucket.numel(), bucket.device
        payloads = [self._buffer(("payload", index, r), n, dtype, dev) for r in range(self._size)]
        payloads[me].copy_(bucket)
        yield self._exchange({r: payloads[me] for r in peers}, {r: payloads[r] for r in peers})
        reference_mean(payloads, _wire_name(dtype), out=bucket, scratch=self._buffer(("scratch", index), n, torch.float32, dev))

    def _scatter_gather(self, bucket: torch.Tensor, dtype: torch.dtype, index: int) -> Iterator[list]:
        me, w, dev = self._rank, self._size, bucket.device
        peers = [r for r in range(w) if r != me]
        shard = -(-bucket.numel() // w)
        padded = self._buffer(("padded", index), shard * w, dtype, dev)
        padded[: bucket.numel()].copy_(bucket)
        padded[bucket.numel() :].zero_()
        received = self._buffer(("received", index), shard * w, dtype, dev)
        yield [dist.all_to_all_single(received, padded, group=self._group, async_op=True)]
        gathered = self._buffer(("gathered", index), shard * w, torch.float32, dev)
        shards = list(gathered.split(shard))
        scratch = self._buffer(("scratch", index), shard, torch.float32, dev)
        reference_mean(list(received.split(shard)), _wire_name(dtype), out=shards[me], scratch=scratch)
        yield self._exchange({r: shards[me] for r in peers}, {r: shards[r] for r in peers})
        bucket.copy_(gathered[: bucket.numel()])

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        tensors = self._check(tensors)
        if not 0 <= src < self._size:
            raise ValueError(f"src={src!r} is invalid: expected a rank in [0, {self._size - 1}]")
        deadline = time.monotonic() + timeout
        try:
            works = [dist.broadcast(t, self._global_rank(src), group=self._group, async_op=True) for t in tensors]
            for work in works:
                left = deadline - time.monotonic()
                if left <= 0 or not work.wait(timeout=datetime.timedelta(seconds=left)):
                    raise TransportError(f"torch.distributed broadcast did not finish within {timeout:g}s")
        except RuntimeError as e:
            raise _transport_error("broadcast", e, timeout, deadline) from e

    def close(self) -> None:
        """Mark the transport closed; the process group stays its creator's to destroy."""
        self._closed = True

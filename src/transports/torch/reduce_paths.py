"""The three ways a bucket's reduce travels over torch.distributed (``wire_bytes.path_of`` picks one):
the backend's ring all-reduce (fp32, no payload seen), every payload to every rank, or a reduce-scatter
of shard payloads then an all-gather of the fp32 shards. Each is a generator of the works it waits for,
run on the transport's communication thread; the last two merge with ``Merge.of``."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from diloco_core import Codec, LeftOut, Merge

from .buffers import Buffers
from .wire_bytes import shard_numel

__all__ = ["ReducePaths"]


class ReducePaths:
    """The reduce paths of one member (``rank`` of ``size``) of ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None, *, rank: int, size: int) -> None:
        self._group = group
        self._rank = rank
        self._size = size

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self._group is None else dist.get_global_rank(self._group, group_rank)

    def ring(
        self, bucket: torch.Tensor, *, buffers: Buffers, index: int, start: int
    ) -> Iterator[list]:
        yield [dist.all_reduce(bucket, group=self._group, async_op=True)]
        bucket.div_(self._size)

    def _exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> list:
        # One batch: NCCL would deadlock on unbatched sends that both peers post before their receives.
        ops = [
            dist.P2POp(dist.isend, t, self.global_rank(r), self._group) for r, t in sends.items()
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.global_rank(r), self._group) for r, t in recvs.items()
        ]
        return dist.batch_isend_irecv(ops)

    def gather_all(
        self,
        bucket: torch.Tensor,
        *,
        codec: Codec,
        merge: Merge,
        left_out: list[LeftOut],
        buffers: Buffers,
        index: int,
        start: int,
    ) -> Iterator[list]:
        me = self._rank
        peers = [r for r in range(self._size) if r != self._rank]
        n = bucket.numel()
        size, dtype = codec.payload_spec(n)
        payloads = [buffers.get(("payload", index, r), size, dtype) for r in range(self._size)]
        codec.encode(bucket, out=payloads[me])
        yield self._exchange({r: payloads[me] for r in peers}, {r: payloads[r] for r in peers})
        # a cast's mean widens into scratch; a block codec's needs none
        cast = codec.elementwise_dtype is not None
        scratch = buffers.get(("scratch", index), n, torch.float32) if cast else None
        who = [f"rank {r}" for r in range(self._size)]
        left_out += merge.of(
            payloads, codec=codec, out=bucket, scratch=scratch, start=start, who=who
        )

    def scatter_gather(
        self,
        bucket: torch.Tensor,
        *,
        codec: Codec,
        merge: Merge,
        left_out: list[LeftOut],
        buffers: Buffers,
        index: int,
        start: int,
    ) -> Iterator[list]:
        me = self._rank
        w = self._size
        n = bucket.numel()
        peers = [r for r in range(w) if r != me]
        shard = shard_numel(n, w, codec.block)
        size, dtype = codec.payload_spec(shard)
        send = buffers.get(("send", index), size * w, dtype)
        # each shard encoded on its own, at its own length: the last one(s) may be short or empty, their payload
        # first in its slot (padding with zeros would change the sign codec's scale of a partial last block)
        lengths = [max(0, min(n - r * shard, shard)) for r in range(w)]
        for r in range(w):
            used = codec.payload_spec(lengths[r])[0]
            codec.encode(
                bucket[r * shard : r * shard + lengths[r]], out=send[r * size : r * size + used]
            )
        received = buffers.get(("received", index), size * w, dtype)
        yield [dist.all_to_all_single(received, send, group=self._group, async_op=True)]
        gathered = buffers.get(("gathered", index), shard * w, torch.float32)
        shards = list(gathered.split(shard))
        mine, used = lengths[me], codec.payload_spec(lengths[me])[0]
        scratch = (
            buffers.get(("scratch", index), shard, torch.float32)
            if codec.elementwise_dtype is not None
            else None
        )
        payloads = [p[:used] for p in received.split(size)]
        left_out += merge.of(
            payloads,
            codec=codec,
            out=shards[me][:mine],
            scratch=None if scratch is None else scratch[:mine],
            start=start + me * shard,
            who=[f"rank {r}" for r in range(w)],
        )
        yield self._exchange({r: shards[me] for r in peers}, {r: shards[r] for r in peers})
        bucket.copy_(gathered[:n])

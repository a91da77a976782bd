"""How the torch transport moves one reduce, and the bytes each rank sends for it (the module docstring of
``transport`` explains the paths). One home for the rule and its arithmetic: the transport reports its bytes
with it, and ``diloco plan`` predicts them with it."""

from __future__ import annotations

import enum

import torch

from diloco_core import Codec, MergeRule

__all__ = ["GATHER_RANKS", "Path", "bytes_out", "path_of", "shard_numel"]


class Path(enum.Enum):
    RING = "ring"  # torch's own all-reduce of fp32 buckets
    GATHER = "gather"  # every rank sends its payload to every peer
    SCATTER_GATHER = "scatter-gather"  # shard payloads all-to-all, fp32 shard sums all-gathered


GATHER_RANKS = 8
"""The most ranks whose payloads ``path_of`` sends to every peer by itself: each rank then decodes W whole
payloads (and the robust merge sums a W x W Gram matrix over them) where scatter-gather decodes W shards."""


def path_of(codec: Codec, *, rule: MergeRule, world_size: int, narrow: Path | None = None) -> Path:
    """The path a reduce of ``codec`` takes: fp32 rings unless a robust merge has a majority to judge; a
    narrower wire's payloads go to every peer unless all-gathering fp32 shard sums sends fewer bytes, i.e.
    while W - 1 payloads' bytes per value are at most an fp32 value's 4 (fp16 up to 3 ranks, int8 4; int4,
    int2, sign and topk up to ``GATHER_RANKS``): the sparse and 2-bit wires stay unreduced where they pay.
    ``narrow`` (GATHER or SCATTER_GATHER): the narrower wires' path whatever the bytes (``TorchDistConfig.path``:
    past ``GATHER_RANKS``, int2's bytes favour gathering up to 16 ranks, sign's 29, topk's at its defaults 114)."""
    fp32 = codec.elementwise_dtype == torch.float32
    if fp32 and (rule is MergeRule.MEAN or world_size < 3):
        return Path.RING
    if narrow is not None and not fp32:
        return narrow
    probe = 2**10 * codec.block  # whole blocks: payload bytes per value without a partial block's
    if (
        not fp32
        and world_size <= GATHER_RANKS
        and (world_size - 1) * codec.payload_bytes(probe) <= 4 * probe
    ):
        return Path.GATHER
    return Path.SCATTER_GATHER


def shard_numel(numel: int, world_size: int, block: int) -> int:
    """Values per rank's shard: ``numel / world_size`` rounded up to a multiple of the codec's block."""
    return -(-numel // (world_size * block)) * block


def bytes_out(numel: int, codec: Codec, *, path: Path, world_size: int) -> int:
    """Payload bytes one rank sends to reduce ``numel`` values (the 40-byte identity header aside)."""
    w = world_size
    if path is Path.RING:
        return 2 * (w - 1) * numel * 4 // w
    if path is Path.GATHER:
        return (w - 1) * codec.payload_bytes(numel)
    shard = shard_numel(numel, w, codec.block)
    return (w - 1) * (codec.payload_bytes(shard) + shard * 4)

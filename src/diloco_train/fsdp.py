"""FSDP2 islands in the trainer: ``train.fsdp_shards`` ranks shard one model and train it as one DiLoCo worker.

Under torchrun the world is laid out as islands of ``fsdp_shards`` consecutive ranks (``transports.islands``):
each island shards the model with ``fully_shard`` (every block, then the root) and trains on as many data
shards as it has ranks, one per rank; DiLoCo averages each rank's shards with the ranks holding the same
shards in the other islands. Island 0's ranks evaluate together (a sharded forward needs all of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .model import Llama

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["evaluates", "shard_model"]


def evaluates(rank: int, fsdp_shards: int) -> bool:
    """Whether ``rank`` takes part in evaluations: island 0's ranks (rank 0 alone without FSDP)."""
    return rank < fsdp_shards


def shard_model(model: Llama, shards: int, device: torch.device) -> DeviceMesh:
    """Shard ``model`` in place over the islands' "shard" dim; the mesh (islands x ``shards``)."""
    from torch.distributed.fsdp import fully_shard

    from transports.islands import island_mesh

    mesh = island_mesh(shards, device.type)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return mesh

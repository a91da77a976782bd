"""FSDP2 islands: DiLoCo between groups of ranks that shard one model with ``fully_shard``.

A 2-D ``DeviceMesh`` (islands x shards) lays out the world: the ranks of one row, an island, shard the
model with ``fully_shard(module, mesh=mesh["shard"])`` and train it together as one DiLoCo worker; the
ranks of one column hold the same shards in every island. ``DiLoCo`` works on the local shards of the
model's DTensor parameters, so its transport is the column: a ``TorchDistTransport`` on the mesh's
"island" sub-group. Each rank then averages only its own shards, and sends parameters / shard degree
bytes per round. ``island_transport`` checks the model's layout first and refuses what it cannot
average shard by shard (a parameter not sharded, on another mesh, HSDP's or TP's 2-D placements).

    mesh = island_mesh(shards=2)                      # world 4: islands [[0, 1], [2, 3]]
    for block in model.layers:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    diloco = DiLoCo(model, inner_optimizer, island_transport(model, mesh), config)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from .torch import TorchDistTransport
from .torch.wire_bytes import Path

__all__ = ["check_islands", "island_mesh", "island_transport"]

ISLAND, SHARD = "island", "shard"


def island_mesh(shards: int, device_type: str = "cpu") -> DeviceMesh:
    """The world (an initialized process group) as ``world_size // shards`` islands of ``shards`` ranks each:
    ranks ``[i * shards, (i + 1) * shards)`` form island i (with torchrun, consecutive ranks share a node)."""
    if not dist.is_initialized():
        raise ValueError(
            "island_mesh needs an initialized process group (dist.init_process_group, or torchrun)"
        )
    world = dist.get_world_size()
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1 or world % shards:
        raise ValueError(
            f"shards={shards!r} is invalid: expected a divisor of the world size {world}"
        )
    return init_device_mesh(device_type, (world // shards, shards), mesh_dim_names=(ISLAND, SHARD))


def _where(t: DTensor) -> str:
    return f"on mesh {t.device_mesh} with placements {tuple(t.placements)}"


def check_islands(
    model: torch.nn.Module, mesh: DeviceMesh, *, island_dim: str = ISLAND, shard_dim: str = SHARD
) -> None:
    """``ValueError`` unless ``mesh`` has both dims and every parameter of ``model`` (and any DTensor buffer)
    is sharded by FSDP2 over ``mesh[shard_dim]`` alone, one ``Shard`` placement; plain buffers are fine."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or island_dim not in names or shard_dim not in names:
        raise ValueError(
            f"FSDP islands need a 2-D DeviceMesh with dims ({island_dim!r}, {shard_dim!r}) (island_mesh builds "
            f"one); got a {mesh.ndim}-D mesh with dims {names}"
        )
    shards = mesh[shard_dim]
    how = f"shard every module with fully_shard(module, mesh=mesh[{shard_dim!r}]), the root module last"
    parameters = {id(p) for p in model.parameters()}
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        if not isinstance(t, DTensor):
            if id(t) in parameters:
                raise ValueError(f"parameter {name!r} is not sharded (a plain tensor): {how}")
            continue  # a buffer: FSDP2 leaves buffers whole on every rank
        if t.device_mesh.ndim != 1:
            raise ValueError(
                f"{name!r} is {_where(t)}, a 2-D layout (HSDP, or FSDP with tensor parallelism): DiLoCo averages "
                f"across {island_dim!r} itself, so the model must be sharded over {shard_dim!r} only: {how}"
            )
        if t.device_mesh != shards:
            raise ValueError(
                f"{name!r} is {_where(t)}, not on mesh[{shard_dim!r}] ({shards}): {how}"
            )
        if len(t.placements) != 1 or not t.placements[0].is_shard():
            raise ValueError(
                f"{name!r} is {_where(t)}; FSDP islands take FSDP2's one Shard placement: {how}"
            )


def island_transport(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    island_dim: str = ISLAND,
    shard_dim: str = SHARD,
    bucket_mb: float = 8.0,
    timeout: float | None = None,
    narrow: Path | None = None,
) -> TorchDistTransport:
    """The transport of this rank's column of ``mesh``: the ranks holding the same shards, one per island
    (its ``rank`` is this rank's island, its ``world_size`` the number of islands). Checks ``model``'s
    layout first (``check_islands``). ``timeout``: the process group's own, for ``own_timeout``; ``narrow``:
    the narrower wires' path (``TorchDistConfig.path``), None: the fewest bytes."""
    check_islands(model, mesh, island_dim=island_dim, shard_dim=shard_dim)
    group = mesh.get_group(island_dim)
    return TorchDistTransport(group, bucket_mb=bucket_mb, timeout=timeout, narrow=narrow)

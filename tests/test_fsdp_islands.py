"""FSDP2 islands: DiLoCo between groups of ranks that shard one model with fully_shard (real gloo processes).

Each layout (islands x shards) is compared with an unsharded run of as many workers as islands, on the same
seeds and data: an island's shard ranks each take their slice of the batch its unsharded worker takes whole,
so FSDP's averaged gradient is the unsharded worker's (up to summation order).
"""

from __future__ import annotations

import functools

import pytest
import torch
from world import GlooWorld, RankError

pytestmark = pytest.mark.timeout(240)

ROUNDS, H, BATCH = 3, 4, 8


class Net(torch.nn.Module):
    """Two layers, a frozen parameter and a float buffer: 2632 trainable values, all even over 2 shards at
    ``outputs=8``; at 7 the output layer's rows split 4 + 3."""

    def __init__(self, outputs: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp, self.out = torch.nn.Linear(32, 64), torch.nn.Linear(64, outputs)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
        self.bias = torch.nn.Parameter(torch.randn(outputs, generator=g), requires_grad=False)
        self.register_buffer("scale", torch.ones(outputs) * 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) * self.scale + self.bias


def _batch(island: int, step: int, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An island's batch of a step: inputs, and a fixed teacher's outputs (so that the loss can fall)."""
    teacher = torch.randn(32, outputs, generator=torch.Generator().manual_seed(7))
    x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(1000 * island + step))
    return x, x @ teacher


def _build(world_transport, shards: int, outputs: int):
    """(model, transport, island, shard rank, shards): sharded over an island mesh when ``shards`` > 0."""
    from torch.distributed.fsdp import fully_shard

    from transports.islands import island_mesh, island_transport

    model = Net(outputs)
    if not shards:
        return model, world_transport, world_transport.rank, 0, 1
    mesh = island_mesh(shards)
    fully_shard(model.inp, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    coord = mesh.get_coordinate()
    return model, island_transport(model, mesh, timeout=60), coord[0], coord[1], shards


def _gathered(diloco) -> list[torch.Tensor]:
    """The global params, whole: each DTensor's local global copy gathered over its shard mesh."""
    from torch.distributed.tensor import DTensor

    out = []
    for p, g in zip(diloco.params, diloco.global_params):
        if isinstance(p, DTensor):
            g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        out.append(g.clone())
    return out


def _run(
    world_transport,
    shards: int,
    *,
    outputs: int = 8,
    rounds: int = ROUNDS,
    save: str | None = None,
    load: str | None = None,
):
    """Train ``rounds`` rounds of H steps; ``load``: resume from this rank's saved state first; ``save``: save
    this rank's state at the end. Returns the gathered global params, the bytes each round sent, this rank's
    whole state (local tensors) and the loss of each step."""
    from diloco_core import DiLoCo, DiLoCoConfig

    torch.manual_seed(0)
    model, transport, island, shard, n = _build(world_transport, shards, outputs)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.5, reduce_timeout=60)
    diloco = DiLoCo(model, inner, transport, config)
    if load is not None:
        diloco.load_state_dict(torch.load(f"{load}/rank{world_transport.rank}.pt", weights_only=True))
    sent, losses = [], []
    while diloco.round < rounds:
        x, y = _batch(island, diloco.inner_step, outputs)
        rows = slice(shard * BATCH // n, (shard + 1) * BATCH // n)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        report = diloco.step()
        inner.zero_grad()
        losses.append(loss.item())
        if report is not None:
            sent.append(report.bytes_sent)
    state = diloco.state_dict()
    if save is not None:
        torch.save(state, f"{save}/rank{world_transport.rank}.pt")
    local = [t.clone() for t in state["model"]] + [state["global"].clone()]
    local += [s["momentum_buffer"].clone() for s in diloco.outer_optimizer.state.values()]
    local += [t.to_local().clone() if hasattr(t, "to_local") else t for s in inner.state.values() for t in s.values()]
    return _gathered(diloco), sent, local, losses, diloco.reduce_numel


def _ok(results: list) -> list:
    assert not any(isinstance(r, RankError) for r in results), results
    return results


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    diff = torch.cat([(x - y).reshape(-1) for x, y in zip(a, b)]).norm()
    return float(diff / torch.cat([y.reshape(-1) for y in b]).norm())


@pytest.mark.parametrize(
    "islands,shards,outputs",
    [
        pytest.param(2, 2, 8, marks=pytest.mark.slow),  # ~8 s: shards that divide evenly; 7 outputs below do not
        pytest.param(1, 2, 8, marks=pytest.mark.slow),  # the degenerate meshes: one island, or unsharded islands
        pytest.param(2, 1, 8, marks=pytest.mark.slow),  # (-m slow; the default run keeps it under 8 minutes)
        (2, 2, 7),
    ],
)
def test_sharded_islands_match_the_unsharded_run_at_a_shard_of_the_bytes(islands, shards, outputs, tmp_path):
    (tmp_path / "sharded").mkdir()
    (tmp_path / "unsharded").mkdir()
    world = GlooWorld(islands * shards, str(tmp_path / "sharded"))
    try:
        sharded = _ok(world.run(functools.partial(_run, shards=shards, outputs=outputs), timeout=150))
    finally:
        world.close()
    world = GlooWorld(islands, str(tmp_path / "unsharded"))
    try:
        unsharded = _ok(world.run(functools.partial(_run, shards=0, outputs=outputs), timeout=150))
    finally:
        world.close()
    want, want_sent = unsharded[0][0], unsharded[0][1]
    numel = sum(p.numel() for p in want)
    # fp32 ring at 2 islands: 4 bytes per value sent; a valid flag, the work, a digest and its square and a
    # diagnostic value ride with each pseudo-gradient
    assert want_sent == [4 * (numel + 5) if islands == 2 else 0] * ROUNDS
    for rank, (params, sent, _, losses, reduced) in enumerate(sharded):
        rel = _relative(params, want)
        print(f"{islands}x{shards} rank {rank}: relative error {rel:.3g}, bytes/round {sent} vs unsharded {want_sent}")
        assert rel < 1e-6, rel
        assert all(torch.equal(a, b) for a, b in zip(params, sharded[0][0]))  # every rank gathers the same
        assert sent == [4 * reduced if islands == 2 else 0] * ROUNDS  # this rank's shard only
        if outputs == 8:  # even shards: exactly a shard degree's fraction of the values
            assert reduced == numel // shards + 5
        print(f"  losses first round {[round(v, 2) for v in losses[:H]]}, last {[round(v, 2) for v in losses[-H:]]}")
        assert sum(losses[-H:]) < sum(losses[:H])  # the last round's mean loss is below the first's
    # the island's ranks reduce the model's values between them, once (plus each rank's 5 guard and diagnostic values)
    assert sum(r[4] for r in sharded[:shards]) == numel + 5 * shards


def test_a_sharded_run_resumes_bit_exactly_from_per_rank_state(tmp_path):
    world = GlooWorld(4, str(tmp_path))
    try:
        straight = _ok(world.run(functools.partial(_run, shards=2), timeout=150))
        _ok(world.run(functools.partial(_run, shards=2, rounds=2, save=str(tmp_path)), timeout=150))
        # fresh processes, a fresh process group: only the files carry the state
        resumed = _ok(world.run(functools.partial(_run, shards=2, load=str(tmp_path)), timeout=150, fresh=True))
    finally:
        world.close()
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))  # global params, gathered
        assert len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))  # the whole state
        assert a[3][-H:] == b[3][-H:]  # the last round's losses


def _layouts(world_transport) -> dict[str, str]:
    """What each unsupported layout says (4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from diloco_core import DiLoCo, DiLoCoConfig
    from transports.islands import island_mesh, island_transport

    mesh = island_mesh(2)
    out = {}

    def attempt(what, build, transport=None):
        model = Net()
        build(model)
        try:
            t = transport or island_transport(model, mesh, timeout=60)
            DiLoCo(model, torch.optim.SGD(model.parameters()), t, DiLoCoConfig(reduce_timeout=60))
            out[what] = "accepted"
        except ValueError as e:
            out[what] = str(e)

    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    out["1-D mesh"] = _error(lambda: island_transport(Net(), flat))
    attempt("plain parameter", lambda m: fully_shard(m.inp, mesh=mesh["shard"]))
    attempt("HSDP", lambda m: fully_shard(m, mesh=mesh))
    attempt("mixed meshes", lambda m: (fully_shard(m.inp, mesh=mesh["island"]), fully_shard(m, mesh=mesh["shard"])))
    attempt("world group", lambda m: fully_shard(m, mesh=mesh["shard"]), transport=world_transport)
    return out


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "accepted"


def test_unsupported_layouts_are_refused_with_what_to_do(tmp_path):
    world = GlooWorld(4, str(tmp_path))
    try:
        results = _ok(world.run(_layouts, timeout=150))
    finally:
        world.close()
    said = results[1]
    assert "2-D DeviceMesh with dims ('island', 'shard')" in said["1-D mesh"]
    assert "parameter 'bias' is not sharded" in said["plain parameter"]
    assert "a 2-D layout (HSDP" in said["HSDP"]
    assert "'inp.weight' is on mesh" in said["mixed meshes"] and "not on mesh['shard']" in said["mixed meshes"]
    # the core's own check, with the world group as transport: ranks 0 and 1 hold different shards
    assert "shard (1,) of (Shard(dim=0),)" in said["world group"] and "transports.islands" in said["world group"]

"""Three hivemind peers with a quorum, where some sleep before some rounds (``stalls.stalled_rounds``): the
hivemind quorum and catch-up tests."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from stalls import stalled_rounds
from threads import in_threads
from world import FAST

from transports.hivemind import HivemindConfig, HivemindTransport


def stalled_swarm(
    *,
    name: str,
    grace: float,
    matchmaking_time: float,
    grad: Callable[[int], torch.Tensor],
    stall: dict[tuple[int, int], float],
    rounds: Callable[[int], int],
) -> list[tuple[torch.Tensor, list]]:
    """Three peers on 127.0.0.1 (quorum 2, ``target_group_size`` 3: docs/wan.md's full group at once), peer r
    running ``rounds(r)`` DiLoCo steps of ``stalled_rounds``; each peer's result, by rank."""
    cfg = {"run_id": f"{name}-{os.getpid()}", "secret": "s", **FAST, "matchmaking_time": matchmaking_time}
    cfg |= {"quorum": 2, "grace_seconds": grace, "target_group_size": 3}
    peers = [HivemindTransport(HivemindConfig(**cfg))]
    peers += [HivemindTransport(HivemindConfig(**cfg, initial_peers=peers[0].join_addresses)) for _ in range(2)]
    results: list = [None] * 3
    try:

        def body(rank: int) -> None:
            t = peers[rank]
            results[rank] = stalled_rounds(
                t, rank=rank, grad=grad, stall=stall, rounds=rounds(rank), reduce_timeout=t.own_timeout
            )

        in_threads(body, 3, timeout=200, what="hivemind peers")
    finally:
        for p in peers:
            p.close()
    return results

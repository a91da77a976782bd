"""How each transport carries one sync, for ``diloco plan``: the bytes each worker sends and the one-way
latencies it waits for one after another (a ``Route``).

- ``torch``: the bytes of its paths (``transports.torch.wire_bytes``); latencies from the collectives'
  algorithms as gloo runs them: the identity header's all-gather (a ring: W - 1 hops), then a ring
  all-reduce's 2(W - 1), or the payloads' pairwise exchange (1), or an all-to-all (1) and the fp32 shard
  sums' all-gather (W - 1). Not validated against a run with latency.
- ``hivemind``: every member's payload reaches every other member, part by part through the part's owner
  (W - 1 payloads out of each member, as the transport counts them); the latencies are the round's phases
  (``HIVEMIND_PHASES``), each measured as the extra time the last peer to arrive spent in it when the link's
  one-way latency grew from 0 to 200 ms (4 peers, ``bench/reachability.py --delay 0.1``; docs/wan.md), and
  explained by the protocol where it can be. The swarm's DHT is taken as small enough that a lookup asks the
  peers holding a key at once (one round trip; hivemind's DHT adds one per doubling beyond its bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_core import Codec, MergeRule, codec_for
from transports.torch.wire_bytes import Path, bytes_out, path_of

__all__ = ["HIVEMIND_PHASES", "TRANSPORTS", "Route", "route"]

TRANSPORTS = ("torch", "hivemind")

HIVEMIND_PHASES = (
    ("the swarm's presence records read (a DHT lookup: a round trip)", 2),
    ("matchmaking: the DHT's leader lookup, the join request, the leader's reply and start", 9),
    ("payloads to each part's owner and theirs back (a stream's first flow-control window)", 4),
    ("relayed payloads' digests to every groupmate, each acknowledged", 2),
    ("the confirmation to every groupmate, each acknowledged", 2),
)
"""A hivemind round's phases and the one-way latencies each costs (measured: 2.0, 8.7, 3.7, 2.0, 2.0)."""


@dataclass(frozen=True)
class Route:
    """One sync on a transport: ``bytes_out`` bytes out of each worker, ``latencies`` one-way latencies."""

    bytes_out: int
    latencies: int


def route(
    params: int,
    codec: str | Codec,
    *,
    transport: str,
    workers: int,
    rule: MergeRule = MergeRule.ROBUST,
) -> Route:
    """How ``transport`` reduces ``params`` values on ``codec`` among ``workers`` workers."""
    c = codec_for(codec)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is invalid: expected one of {list(TRANSPORTS)}")
    if workers < 2:
        return Route(bytes_out=0, latencies=0)
    if transport == "hivemind":
        return Route(
            bytes_out=(workers - 1) * c.payload_bytes(params),
            latencies=sum(n for _, n in HIVEMIND_PHASES),
        )
    path = path_of(c, rule=rule, world_size=workers)
    hops = {
        Path.RING: 2 * (workers - 1),
        Path.GATHER: 1,
        Path.SCATTER_GATHER: workers,
    }[path]
    return Route(
        bytes_out=bytes_out(params, c, path=path, world_size=workers),
        latencies=workers - 1 + hops,
    )

"""How each transport carries one sync, for ``diloco plan``: the bytes each worker sends and the
one-way latencies it waits for one after another (a ``Route``).

- ``torch``: the bytes of its paths (``transports.torch.wire_bytes``); latencies from the
  collectives' algorithms as gloo runs them: the identity header's all-gather (a ring: W - 1 hops),
  then a ring all-reduce's 2(W - 1), or the payloads' pairwise exchange (1), or an all-to-all (1)
  and the fp32 shard sums' all-gather (W - 1). Not validated against a run with latency.
- ``hivemind``: every member's payload reaches every other member, part by part through the part's
  owner (the public members: ``clients`` behind NAT own none); the bytes are the busiest member's,
  an owner's (W - 1 payloads where every member owns a part, as the transport counts them). The
  latencies are the round's phases (``HIVEMIND_PHASES``), each measured as the extra time the last
  peer to arrive spent in it when the one-way latency grew (4 public peers: 0 to 200 ms; 1 public
  and 3 clients: 0 to 100 ms; ``bench/reachability.py``; docs/wan.md), and explained by the
  protocol: an owner's stream back to a member waits a round trip for each flow-control window after
  the first (yamux's: 256 KiB, doubling), and between two clients every message crosses the relay
  (twice the latency). The swarm's DHT is taken as small enough that a lookup asks the peers holding
  a key at once (one round trip; hivemind's DHT adds one per doubling beyond its bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco_core import Codec, MergeRule, codec_for
from transports.torch.wire_bytes import Path, bytes_out, path_of

__all__ = ["HIVEMIND_PHASES", "STREAM_WINDOW", "TRANSPORTS", "Route", "route"]

TRANSPORTS = ("torch", "hivemind")

HIVEMIND_PHASES = (
    ("the swarm's presence records read (a DHT lookup: a round trip)", 2),
    ("matchmaking: the DHT's leader lookup, the join request, the leader's reply and start", 9),
    ("payloads to each part's owner and theirs back, a round trip per window after the first", 2),
    ("the relayed payloads' digests to every groupmate, each acknowledged (relayed)", 2),
    ("the confirmation to every groupmate, each acknowledged (relayed)", 2),
)
"""A hivemind round's phases and the one-way latencies each costs with every member public
("relayed": twice as long between two clients). Measured, 4 public peers: 2.0, 8.7, 3.7 with one
window more, 2.0, 2.0; 1 public and 3 clients: 2.0, 8.0, 7.5 with two windows more, 3.9 and 4.0
relayed."""
STREAM_WINDOW = 256 * 1024
"""Bytes a libp2p (yamux) stream sends before the receiver's first window update; each next window
doubles."""


@dataclass(frozen=True)
class Route:
    """One sync on a transport: ``bytes_out`` bytes out of the busiest worker (every worker alike on
    torch), and the one-way latencies it waits for (``latencies``)."""

    bytes_out: int
    latencies: int


def route(
    params: int,
    codec: str | Codec,
    *,
    transport: str,
    workers: int,
    rule: MergeRule = MergeRule.ROBUST,
    clients: int = 0,
) -> Route:
    """How ``transport`` reduces ``params`` values on ``codec`` among ``workers`` workers,
    ``clients`` of them behind NAT (hivemind)."""
    c = codec_for(codec)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is invalid: expected one of {list(TRANSPORTS)}")
    if not 0 <= clients < max(workers, 1):
        raise ValueError(
            f"clients={clients!r} is invalid: expected in [0, workers - 1 = {workers - 1}]"
            " (a group of clients alone cannot average)"
        )
    if clients and transport != "hivemind":
        raise ValueError(
            f"clients={clients!r} is invalid on {transport}: peers behind NAT are hivemind's"
        )
    if workers < 2:
        return Route(bytes_out=0, latencies=0)
    if transport == "hivemind":
        return _hivemind(c.payload_bytes(params), workers=workers, clients=clients)
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


def _hivemind(payload: int, *, workers: int, clients: int) -> Route:
    owners = workers - clients
    part = payload / owners
    # an owner's stream back to one member: the others' payloads of its part, in windows of 256 KiB,
    # then doubling
    back = (workers - 1) * part
    windows = math.ceil(math.log2(back / STREAM_WINDOW + 1))
    # between two clients, every message goes through a public peer's relay
    relayed = 2 if clients >= 2 else 1
    presence, matchmaking, payloads, digests, confirmation = (n for _, n in HIVEMIND_PHASES)
    waits = payloads + 2 * (windows - 1) + relayed * (digests + confirmation)
    return Route(
        bytes_out=round((workers - 1) * back + (owners - 1) * part),  # an owner's: the busiest
        latencies=presence + matchmaking + waits,
    )

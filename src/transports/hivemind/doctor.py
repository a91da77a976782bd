"""What would stop a hivemind peer from joining its run, found before the run: ``diloco doctor``.

Within about 10 seconds, one line each: whether this peer is public or a client
(``reachability.decide``), which initial peers answer a TCP connection (address, round trip, or the
error), which of them answer as peers of this run (the run's DHT, with its secret: a wrong
``run_id`` or secret fails here), the round trip and clock offset to each (hivemind refuses a peer
more than 3 s off), and for a client whether a relay took it. Bandwidth is not measured: that needs
a peer to send data, which only members' rounds do.
"""

import concurrent.futures
import socket
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from hivemind.dht.protocol import MAX_DHT_TIME_DISCREPANCY_SECONDS
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from diloco_core.transport import TransportError

from .auth import run_keys
from .faults import HivemindFaults
from .hivemind_config import HivemindConfig
from .reachability import decide, maddr_parts, relayed
from .resources import Resources
from .secret import read_secret

__all__ = ["Finding", "diagnose"]

TCP_TIMEOUT = 3.0


@dataclass(frozen=True)
class Finding:
    ok: bool
    line: str
    warn: bool = False
    """Worth fixing, but a run would work (a dead initial peer beside a live one)."""


def _tcp(maddr: str) -> Finding:
    host, port, _ = maddr_parts(maddr)
    if host is None or port is None or "/p2p-circuit" in maddr:
        return Finding(True, f"initial peer {maddr}: not a direct TCP address; not probed")
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=TCP_TIMEOUT):
            ms = 1000 * (time.monotonic() - start)
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or repr(e))
        advice = "is the address right (the first peer prints it) and is that peer running?"
        return Finding(False, f"initial peer {maddr}: no TCP connection ({why}): {advice}")
    return Finding(True, f"initial peer {maddr}: TCP connection in {ms:.0f} ms")


async def _ping(dht: Any, node: Any, *, peer: str) -> tuple[float, float] | None:
    """Round trip and clock offset (the peer's DHT time less ours) to ``peer`` (None: no answer)."""
    del dht
    request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False)
    sent = get_dht_time()
    try:
        stub = node.protocol.get_stub(PeerID.from_base58(peer))
        response = await stub.rpc_ping(request, timeout=TCP_TIMEOUT)
    except Exception:  # noqa: BLE001 - any failure is the same verdict: it did not answer
        return None
    got = get_dht_time()
    if response is None or not response.dht_time:
        return None
    return got - sent, response.dht_time - (sent + got) / 2


def _member(res: Resources, maddr: str) -> Finding:
    peer = maddr_parts(maddr)[2]
    if peer is None:
        return Finding(False, f"initial peer {maddr}: no /p2p/<peer id>: copy the whole address")
    got = res.dht.run_coroutine(partial(_ping, peer=peer))
    if got is None:
        return Finding(False, f"initial peer {maddr}: does not answer as a peer of this run")
    rtt, offset = got
    line = f"initial peer {maddr}: a peer of this run; round trip {1000 * rtt:.0f} ms"
    line += f", clock {offset:+.2f} s"
    if abs(offset) > MAX_DHT_TIME_DISCREPANCY_SECONDS:
        return Finding(False, f"{line}: more than {MAX_DHT_TIME_DISCREPANCY_SECONDS} s apart, "
                              "hivemind refuses it: sync this machine's clock (NTP)")  # fmt: skip
    return Finding(True, line)


def diagnose(config: HivemindConfig) -> list[Finding]:
    """One finding per check; a run would work where every one is ok."""
    peers = list(config.initial_peers)
    mode, why = decide(
        config.reachability, initial_peers=peers, announce_maddrs=config.announce_maddrs
    )
    found = [Finding(True, f"this peer: {mode} ({why})")]
    if not peers:
        return [*found, Finding(True, "initial_peers: none: this peer starts the swarm")]
    with concurrent.futures.ThreadPoolExecutor(len(peers)) as pool:
        probes = list(pool.map(_tcp, peers))
    found += probes
    alive = [m for m, f in zip(peers, probes) if f.ok]
    if not alive:
        return [*found, Finding(False, "no initial peer answered: a run would stop at its start")]
    # a dead one beside a live one: a joiner needs only one
    found = [f if f.ok else replace(f, ok=True, warn=True) for f in found]
    keys, _ = run_keys(config.run_id, read_secret(config), joining=True)
    res = Resources(
        config=replace(config, initial_peers=tuple(alive), host_maddrs=("/ip4/0.0.0.0/tcp/0",)),
        faults=HivemindFaults(),
        part_size_bytes=2**19,
        keys=keys,
        probe=True,
    )
    try:
        res.start_dht()
    except TransportError as e:
        return [*found, Finding(False, str(e))]
    try:
        found += [_member(res, m) for m in alive]
        if mode == "client":
            relays = relayed(res.dht.get_visible_maddrs(latest=True))
            line = "relay: no initial peer relays this peer: list a public peer in initial_peers"
            if relays:
                line = f"relay: others reach this peer at {relays[0]}"
            found.append(Finding(bool(relays), line))
    finally:
        res.close()
    return found

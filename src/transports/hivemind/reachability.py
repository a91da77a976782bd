"""Whether others can connect to this peer, and how they reach it where they cannot.

A *public* peer accepts connections, and its p2p daemon serves as a relay for clients (libp2p
circuit relay v2). A *client* cannot accept them (NAT, a container without a forwarded port): its
daemon reserves a slot on its ``initial_peers``' relays as it starts and announces the relayed
address (``/p2p/<relay>/p2p-circuit/p2p/<client>``), so that every peer, clients included, still
opens streams to it: a client owns parts, serves state and answers every call of a round like any
other member; its traffic with other clients crosses the relay's link twice.

``"auto"`` decides before the daemon starts: the swarm's first peer is public; a joiner that
announces a public address is public; a joiner whose own address toward a public initial peer is
private (what the kernel would send from; nothing is sent) is behind NAT: a client; anything else (a
LAN, one machine) is public. libp2p announces a relayed address only through a relay with a public
address, so clients need a public peer among their ``initial_peers``.
"""

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2P

__all__ = ["decide", "maddr_parts", "relay_settings", "relayed"]

_CLIENT = "diloco-client"
# p2pd's flags for a client: private at once (it does not wait for AutoNAT's verdict), and its
# initial peers as static relays, reserved as it starts (with relay discovery, libp2p waits up to
# 3 minutes for 4 candidates first). An entry of hivemind's public table of reachability flags.
P2P.FORCE_REACHABILITY_MAPPING.setdefault(
    _CLIENT, {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
)


def maddr_parts(maddr: str) -> tuple[str | None, int | None, str | None]:
    """Host, TCP port and peer id of a multiaddr (None where it has none)."""
    words = maddr.split("/")
    pairs = dict(zip(words[1::2], words[2::2]))
    host = next((pairs[p] for p in ("ip4", "ip6", "dns", "dns4", "dns6") if p in pairs), None)
    port = int(pairs["tcp"]) if pairs.get("tcp", "").isdigit() else None
    return host, port, pairs.get("p2p")


def _ip(maddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address of a multiaddr (None: it has none, or a DNS name)."""
    host = maddr_parts(maddr)[0]
    try:
        return None if host is None else ipaddress.ip_address(host)
    except ValueError:
        return None


def _source_toward(ip: Any) -> Any:
    """The local address the kernel would send from to reach ``ip`` (None: no route)."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((str(ip), 9))  # a datagram socket's connect sends nothing
        except OSError:
            return None
        return ipaddress.ip_address(s.getsockname()[0])


def decide(
    reachability: str, *, initial_peers: Sequence[str], announce_maddrs: Sequence[str]
) -> tuple[str, str]:
    """``"public"`` or ``"client"``, and why, for the ``reachability`` setting."""
    if reachability != "auto":
        return reachability, "as configured"
    if not initial_peers:
        return "public", "the swarm's first peer"
    if any((ip := _ip(a)) is not None and ip.is_global for a in announce_maddrs):
        return "public", "it announces a public address"
    for maddr in initial_peers:
        ip = _ip(maddr)
        if ip is None or not ip.is_global:
            continue
        mine = _source_toward(ip)
        if mine is not None and not mine.is_global:
            return "client", f"its address {mine} toward {ip} is private (behind NAT)"
        return "public", f"its address {mine} toward {ip} is public"
    return "public", "its initial peers are on a private network with it"


def relay_settings(
    mode: str, *, initial_peers: Sequence[str], addresses: Sequence[str]
) -> dict[str, Any]:
    """hivemind ``DHT``/``P2P`` settings for a ``"public"`` or ``"client"`` peer that listens on or
    announces ``addresses``."""
    if mode == "client":
        relays = list(initial_peers)
        return {"use_auto_relay": True, "force_reachability": _CLIENT, "trusted_relays": relays}
    if all((ip := _ip(a)) is not None and ip.is_loopback for a in addresses):
        return {}  # one machine: nobody to relay, libp2p as before
    return {"force_reachability": "public"}  # its relay service runs at once


def relayed(maddrs: Sequence[Any]) -> list[str]:
    """The relayed addresses among ``maddrs``."""
    return [str(a) for a in maddrs if "/p2p-circuit" in str(a)]

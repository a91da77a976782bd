"""``HivemindConfig``: the ``[transport]`` table of a hivemind run, checked on construction."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from diloco_core.config import check_field, is_finite_number

__all__ = ["HivemindConfig"]


def _maddrs(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(a, str) and a.startswith("/") for a in value)


def _int_at_least(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True, kw_only=True)
class HivemindConfig:
    run_id: str = "diloco"
    """Name of the run: peers with the same run_id (and secret) average together."""
    initial_peers: Sequence[str] = ()
    """Multiaddrs of peers already in the swarm (another peer's ``join_addresses``); empty starts a new swarm."""
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    """Where to listen. The default takes every interface and a free port, as a WAN peer needs; use
    /ip4/127.0.0.1/tcp/0 for a single machine."""
    announce_maddrs: Sequence[str] = ()
    """Addresses to announce to others instead of the listened ones: the public address behind NAT."""
    matchmaking_time: float = 15.0
    """Seconds a peer waits for groupmates before each all-reduce (OpenDiLoCo's 15)."""
    averaging_timeout: float = 120.0
    """Seconds one all-reduce attempt may take once its group has formed."""
    min_group_size: int = 2
    """Smallest group worth averaging with; a peer that finds fewer averages alone (1 contributor)."""
    target_group_size: int | None = None
    """Peers expected in a round: a group starts as soon as this many have joined, without waiting out
    ``matchmaking_time``. Never below the number of peers: more peers than this form a second group,
    and one group's round is dropped when their members next meet. None: every round waits
    ``matchmaking_time`` for whoever comes."""
    background_niceness: int = 0
    """Added to the niceness of this peer's background processes (its averagers, its DHT and p2p daemon),
    0 to 19: where training shares their cores, 10 lets it have them first (eager on 2 cores shared by 2
    peers: 92.8-94.4% utilization against 75.2-88.3% at 0; docs/overlap.md). A reduce runs slower beside it."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret of the run: only peers that hold it can matchmake, average or download state (a slow
    KDF makes guessing it offline cost 0.26 s or more per guess). None: the swarm's first peer generates one
    (``HivemindTransport.join_settings``); a joiner needs it. Under 16 characters: a warning."""

    def __post_init__(self) -> None:
        run_id = self.run_id
        check_field("run_id", run_id, ok=isinstance(run_id, str) and run_id != "", valid="a non-empty string")
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            value = getattr(self, name)
            valid = "a list of multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm..."
            check_field(name, value, ok=_maddrs(value), valid=valid)
            object.__setattr__(self, name, tuple(value))
        check_field("host_maddrs", self.host_maddrs, ok=len(self.host_maddrs) > 0, valid="at least one multiaddr")
        for name in ("matchmaking_time", "averaging_timeout"):
            t = getattr(self, name)
            check_field(name, t, ok=is_finite_number(t) and t > 0, valid="a number of seconds > 0")
        m = self.min_group_size
        check_field("min_group_size", m, ok=_int_at_least(m, 1), valid="an integer >= 1")
        g, low = self.target_group_size, max(2, m)
        valid = f"none or an integer >= max(2, min_group_size) = {low}"
        check_field("target_group_size", g, ok=g is None or _int_at_least(g, low), valid=valid)
        n = self.background_niceness
        ok = _int_at_least(n, 0) and n <= 19
        check_field("background_niceness", n, ok=ok, valid="an integer in [0, 19]")
        s = self.secret
        ok = s is None or (isinstance(s, str) and s != "")
        check_field("secret", "<hidden>" if s else s, ok=ok, valid="a non-empty string or none")

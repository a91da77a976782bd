"""``HivemindConfig``: the ``[transport]`` table of a hivemind run, checked on construction."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from diloco_core.rules import (
    boolean,
    check_field,
    check_fields,
    choice,
    integer,
    number,
    rule,
    string,
)

from ..quorum import Quorum
from .secret import check_sources

__all__ = ["HivemindConfig"]


def _maddrs(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(a, str) and a.startswith("/") for a in value
    )


def _optional(valid: str) -> dict:
    """Field metadata: a non-empty string or None."""
    return rule(lambda v: v is None or (isinstance(v, str) and v != ""), valid)


_MADDRS = rule(_maddrs, "a list of multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm...")


@dataclass(frozen=True, kw_only=True)
class HivemindConfig:
    run_id: str = field(default="diloco", metadata=string(empty=False))
    """Name of the run: peers with the same run_id (and secret) average together."""
    initial_peers: Sequence[str] = field(default=(), metadata=_MADDRS)
    """Multiaddrs of peers already in the swarm (another peer's ``join_addresses``); empty starts a new swarm."""
    host_maddrs: Sequence[str] = field(default=("/ip4/0.0.0.0/tcp/0",), metadata=_MADDRS)
    """Where to listen. The default takes every interface and a free port, as a WAN peer needs; use
    /ip4/127.0.0.1/tcp/0 for a single machine."""
    announce_maddrs: Sequence[str] = field(default=(), metadata=_MADDRS)
    """Addresses to announce to others instead of the listened ones: the public address behind NAT."""
    reachability: str = field(default="auto", metadata=choice(("auto", "public", "client")))
    """Whether others can connect to this peer. "public": it accepts connections (listens on a reachable
    address, or announces one forwarded to it). "client": it cannot (behind NAT, in a container without a
    forwarded port): it reserves a slot on its ``initial_peers``' relays and others reach it through them
    (``reachability.py``). "auto": the swarm's first peer and a peer announcing a public address are
    public; a joiner whose own address toward a public initial peer is private (behind NAT) is a client;
    a LAN is public. It does not test inbound connections. One log line says which and why."""
    matchmaking_time: float = field(default=15.0, metadata=number(gt=0, noun="a number of seconds"))
    """Seconds a peer waits for groupmates before each all-reduce (OpenDiLoCo's 15)."""
    averaging_timeout: float = field(
        default=120.0, metadata=number(gt=0, noun="a number of seconds")
    )
    """Seconds one all-reduce attempt may take once its group has formed."""
    min_group_size: int = field(default=2, metadata=integer(low=1))
    """Smallest group worth averaging with; a peer that finds fewer averages alone (1 contributor)."""
    target_group_size: int | None = field(
        default=None,
        metadata=integer(
            low=lambda c: max(2, c.min_group_size),
            unset=True,
            valid="none or an integer >= max(2, min_group_size) = {low}",
        ),
    )
    """Peers expected in a round: a group starts as soon as this many have joined, without waiting out
    ``matchmaking_time``. Never below the number of peers: more peers than this form a second group,
    and one group's round is dropped when their members next meet. None: every round waits
    ``matchmaking_time`` for whoever comes."""
    quorum: int = field(default=0, metadata=integer(low=0))
    """Peers a round needs to close without the others it expects, once a grace window from its first arrival
    has passed (adaptive to the arrival spread: ``grace.py``); a peer that arrives after its round closed takes
    the round's result. 0: every round waits up to ``matchmaking_time`` for every expected peer."""
    grace_seconds: float = field(default=5.0, metadata=number(gt=0, noun="a number of seconds"))
    """The longest grace window (and never more than ``matchmaking_time``)."""
    background_niceness: int = field(default=0, metadata=integer(low=0, high=19))
    """Added to the niceness of this peer's background processes (its averagers, its DHT and p2p daemon),
    0 to 19: where training shares their cores, 10 lets it have them first (eager on 2 cores shared by 2
    peers: 92.8-94.4% utilization against 75.2-88.3% at 0; docs/overlap.md). A reduce runs slower beside it."""
    release_inherited: bool = field(default=True, metadata=boolean())
    """A forked DHT or averager process gives back the pages of this process's large tensors it
    inherited (``forked.py``): 29 (fp32) to 34 (int4) bytes per parameter less per peer, measured
    between 5M and 20M parameters (docs/results.md, "Scale"). It costs each fork a walk of the process's Python objects (about
    0.06 s at 400k objects); off: no walk, and each child keeps the pages the trainer rewrites."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret of the run: only peers that hold it can matchmake, average or download state (a slow
    KDF makes guessing it offline cost 0.26 s or more per guess). None (and no ``secret_file`` nor
    ``secret_env``): the swarm's first peer generates one (``HivemindTransport.join_settings``); a joiner
    needs it. Under 16 characters: a warning. On a command line it is visible to every local user (``ps``):
    there, use ``secret_file`` or ``secret_env`` (``secret.py``)."""
    secret_file: str | None = field(default=None, metadata=_optional("a path or none"))
    """Path of a file holding the secret (surrounding whitespace dropped), readable by its owner only (mode
    0600: a file its group or others may read is refused). At most one of secret, secret_file, secret_env."""
    secret_env: str | None = field(
        default=None, metadata=_optional("the name of an environment variable or none")
    )
    """Name of an environment variable holding the secret (e.g. ``DILOCO_SECRET``)."""

    @property
    def quorum_rule(self) -> Quorum:
        return Quorum(members=self.quorum, grace_seconds=self.grace_seconds)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_field(
            "host_maddrs",
            self.host_maddrs,
            ok=len(self.host_maddrs) > 0,
            valid="at least one multiaddr",
        )
        s = self.secret
        ok = s is None or (isinstance(s, str) and s != "")
        check_field("secret", "<hidden>" if s else s, ok=ok, valid="a non-empty string or none")
        check_sources(self)

"""The swarm as one peer sees it: which peers are alive and where they are, declared by each in the DHT.

Every peer declares its *presence* (refreshed by its state averager, ``Averager.declare_presence``): the
reduce key it is at or was last at (a hash) and whether it is in that reduce now, the rounds its run state has committed (None before ``attach``), whether it
is joining (waiting in ``attach`` for the swarm's next round), and when it last committed a round and how
long its last round took. From that a peer knows, without waiting:

- how many peers a round should wait for (``expected``): every live peer that runs rounds. Any other
  reduce is not known (peers reduce key after key, in any order: DDP's gradients, a library user's own
  reduces), so the configured ``target_group_size`` and ``matchmaking_time`` decide as before. That is the reduce's ``target_group_size``
  (unless the config sets one): matchmaking ends as soon as they are in, ``matchmaking_time`` only bounds
  the wait for a late or lost one. Expecting only itself, a peer averages alone at once (a lone first
  peer, a joiner's start-up check that the swarm made long ago);
- which peers left (``departed``): a peer a round expected that was not in the group that committed it, and
  whose presence record then went unrefreshed for longer than a live peer refreshes it (dead, or hung). It is
  not expected again until its record is refreshed, so a dead peer costs one round's matchmaking window, not
  one every round until its record expires (or, with ``target_group_size``, every round); one log line names
  it and the round size now. A peer that averaged alone counts its round too: the peers it
  expected missed it (a survivor left alone stops waiting for the peer that left). A live peer
  that sat a round out refreshes its record: it stays expected;
- which peers are benched (``bench``): a peer held to blame for a failed exchange (``blame``) is
  not waited for while benched (its averager turns it away: ``strikes``), so the retry and the
  rounds after it go on without it; one log line names it and why. Blamed itself (its exchanges
  failed with every groupmate), a peer averages alone while benched (``sits_out``);
- when the swarm commits its next round (``wait_for_round``): a joiner waits for it, bounded, and starts
  training from that round's state, in phase with the swarm (else its rounds and the swarm's never meet).
"""

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from hivemind.utils import get_dht_time

from .deadlines import deadlines
from .donor_choice import swarm_round
from .presence import presence_period
from .resources import Resources
from .state_server import StateServer, broadcast_values, rounds_of
from .state_tag import valid_tag
from .strikes import BENCH_MATCHMAKINGS, FailedExchanges

logger = logging.getLogger(__name__)


def key_hash(key: str) -> str:
    """A reduce key as names in the DHT and p2p accept it (and as presence carries it)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class Swarm:
    """This peer's presence, and the others' as last read from the DHT."""

    def __init__(self, *, resources: Resources, key: str) -> None:
        self._res, self._key = resources, key
        # the state averager, which declares the presence (set once it runs)
        self.averager: Any = None
        self._mine: dict = {"key": None, "busy": False, "round": None, "joining": False}
        self._mine.update(committed_at=None, period=None)
        self._counted: set[bytes] = set()  # the peers the last round expected
        self._missing: set[bytes] = set()  # peers counted before whose presence record is gone
        self._rounds_seen: list[Any] = []  # the rounds the others' presence said at the last read
        # this peer and the others with a live record, not departed, at the last read
        self._alive = 1
        # of those, the ones that missed a round: the first one they missed
        self._suspects: dict[bytes, int] = {}
        # suspects whose presence went unrefreshed (its expiration then) or expired (None): kept
        # until it is refreshed again, so a configured target stays capped
        self._departed: dict[bytes, float | None] = {}
        # peers blamed for a failed exchange: until when (monotonic)
        self._benched: dict[bytes, float] = {}
        self._failures = FailedExchanges(
            longest=BENCH_MATCHMAKINGS * resources.config.matchmaking_time
        )
        self._ttl = presence_period(resources.config.matchmaking_time)
        """Seconds a presence record lives: stored again every third of it, so one older than that and a second
        missed its refresh."""

    def declare(self, *, wait: float = 0.0, **fields: Any) -> None:
        if fields.get("busy"):
            # when its reduce began: a joiner reads how late in it it comes
            fields["since"] = get_dht_time()
        self._mine.update(fields)
        if self.averager is not None and not self._res.closed:
            self.averager.declare_presence(dict(self._mine), wait=wait)

    def committed(self, rounds: int, group: list[bytes]) -> None:
        """This peer committed a round of the run state with ``group`` (peer ids; empty: alone): its presence
        says when, and how long the last took; a peer the round expected and ``group`` lacks is a suspect."""
        now, last = get_dht_time(), self._mine["committed_at"]
        self.declare(round=rounds, committed_at=now, period=None if last is None else now - last)
        for p in self._counted | self._missing:  # alone (``group`` empty): every one missed it
            if p not in group:
                self._suspects.setdefault(p, rounds)  # the first round it missed

    def bench(self, peers: Iterable[Any], *, reason: str) -> None:
        """``peers`` (ids, bytes) were blamed for a failed exchange (``blame``): not waited for while
        benched (as long as its groupmates' averagers turn it away: ``strikes.FailedExchanges``);
        this peer among them: it averages alone that long."""
        me = self._res.dht.peer_id.to_bytes()
        for p in peers:
            if not isinstance(p, bytes) or self.benched(p):
                continue
            seconds = self._failures.bench_seconds(p.hex())
            self._benched[p] = time.monotonic() + seconds
            if p == me:
                logger.warning("this peer's part exchange failed with every groupmate (%s): it averages "
                               "alone for %.0f s", reason, seconds)  # fmt: skip
            else:
                logger.warning("peer %s failed its part exchange (%s): rounds go on without it for %.0f s",
                               p.hex()[-8:], reason, seconds)  # fmt: skip

    def benched(self, peer: bytes) -> bool:
        """Whether ``peer`` is benched for a failed exchange now (``bench``)."""
        until = self._benched.get(peer)
        if until is not None and until <= time.monotonic():
            del self._benched[peer]
            return False
        return until is not None

    def sits_out(self) -> bool:
        """Whether this peer is benched itself (its exchanges failed with every groupmate): it averages
        alone."""
        return self.benched(self._res.dht.peer_id.to_bytes())

    @property
    def departed(self) -> int:
        """Peers this peer no longer waits for (``expected``): they missed a round and their presence went
        unrefreshed for longer than a live peer's refresh period (dead or hung)."""
        return len(self._departed)

    def others(self, timeout: float) -> dict[bytes, Any]:
        """The presence record (``.value``, ``.expiration_time``) of every other live peer of the run, by peer id
        ({} if the DHT did not answer within ``timeout``)."""
        me = self._res.dht.peer_id.to_bytes()
        try:
            got = self._res.dht.get(self._key, latest=True, return_future=True).result(timeout)
        except Exception as e:  # noqa: BLE001 - unknown: nobody is expected, matchmaking still meets whoever comes
            logger.debug("presence not read: %r", e)
            return {}
        if got is None or not isinstance(got.value, dict):
            return {}
        now = get_dht_time()
        return {
            peer: v
            for peer, v in got.value.items()
            if peer != me and v.expiration_time > now and isinstance(v.value, dict)
        }

    def expected(self, key: str, *, tracked: bool, timeout: float) -> int | None:
        """Peers (this one included) that a round (``tracked``) should wait for: the live peers that run rounds,
        less those departed. None for any other reduce: not known (peers reduce key after key, in any order),
        so the configured ``target_group_size`` and ``matchmaking_time`` decide, as before."""
        # presence is declared by peers that serve a run state: others may be unseen here
        if not tracked:
            return None
        others = self.others(timeout)
        running = {
            p: (r.value.get("round"), r.expiration_time)
            for p, r in others.items()
            if r.value.get("round") is not None and not r.value.get("joining")
        }
        for p, missed in list(self._suspects.items()):
            seen = running.get(p)
            # it has committed the round it missed, or a later one
            if seen is not None and seen[0] >= missed:
                del self._suspects[p]
            elif (
                seen is None or get_dht_time() - (seen[1] - self._ttl) > self._ttl / 3 + 1.0
            ):  # a refresh missed
                del self._suspects[p]
                self._departed[p] = None if seen is None else seen[1]
                left = 1 + sum(q not in self._departed for q in running)
                logger.warning("peer %s left the swarm's rounds (it missed round %d; its presence %s): rounds now "
                               "wait for %d peer(s)", p.hex()[-8:], missed, "expired" if seen is None else
                               "is no longer refreshed", left)  # fmt: skip
        for p, expires in list(self._departed.items()):
            # refreshed again (a restart is a new peer id)
            if p in running and running[p][1] != expires:
                logger.info(
                    "peer %s is back in the swarm's rounds (at round %s)",
                    p.hex()[-8:],
                    running[p][0],
                )
                del self._departed[p]
        # One counted before whose record is gone now (expired, or the DHT did not answer) is
        # missing: a suspect once a round commits without it, departed at the next read (else a
        # configured target would wait for it every round).
        gone = (self._counted | self._missing) - running.keys() - self._departed.keys()
        # benched ones too: one may leave
        self._counted = {p for p in running if p not in self._departed}
        self._missing = gone
        self._rounds_seen = [r for r, _ in running.values()]
        # whatever they do: a joiner may meet us
        self._alive = 1 + sum(p not in self._departed and not self.benched(p) for p in others)
        return 1 + sum(not self.benched(p) for p in self._counted)

    def target(self, expected: int | None, *, configured: int | None) -> int | None:
        """The group size a reduce waits for: ``configured`` (``target_group_size``), capped once a peer has
        departed or benched by the live peers neither departed nor benched (joiners too: a restarted
        peer may meet this round), else the peers expected (at least 2); None: not known."""
        benched = any(self.benched(p) for p in list(self._benched))
        if configured and expected and (self._departed or benched):
            return min(configured, self._alive)
        return configured or (max(2, expected) if expected else None)

    def ahead(self, rounds: int, *, timeout: float | None = None) -> bool:
        """Whether a live peer that runs rounds has committed more than ``rounds`` rounds: as read now (within
        ``timeout``), or as ``expected`` last read it (None)."""
        if timeout is not None:
            self._rounds_seen = [
                r.value.get("round")
                for r in self.others(timeout).values()
                if not r.value.get("joining")
            ]
        return any(isinstance(r, int) and r > rounds for r in self._rounds_seen)

    def behind_by_two(self, rounds: int) -> bool:
        """Whether the swarm, as ``expected`` last read it, is two rounds or more past ``rounds`` (this peer's):
        by the most rounds at least two peers declare (``donor_choice.swarm_round``), so that one peer's claim
        (an insider's round 10^6) moves nobody."""
        claims = [r for r in self._rounds_seen if isinstance(r, int) and not isinstance(r, bool)]
        credible = swarm_round([*claims, rounds])
        return credible is not None and credible >= rounds + 2

    def absent(self, group: list[bytes]) -> tuple[str, ...]:
        """The peers the last round expected that ``group`` lacks (the ends of their ids, as logs name them)."""
        return tuple(sorted(p.hex()[-8:] for p in self._counted if p not in group))

    def wait_for_round(self, rounds: int, *, timeout: float, stop: Any) -> bool:
        """Wait until a live peer has committed more than ``rounds`` rounds (True): at most ``timeout``
        seconds, or twice the swarm's last round time if that is longer, or until ``stop()`` (False). A
        swarm that has committed no round yet starts its first one with this peer (False). Even a swarm that
        committed a moment ago is waited for: it may commit again before this peer counts as running rounds.
        A swarm in its first round's reduce for over ``matchmaking_time`` is waited for too (a join line pasted
        ~30 s after the first peer started: before, the joiner met the next round a round behind, an ERROR with a
        traceback on both peers, its first round dropped)."""
        start = time.monotonic()
        self.declare(joining=True)
        try:
            while not stop():
                values = [r.value for r in self.others(2.0).values()]
                running = [
                    o for o in values if isinstance(o.get("round"), int) and not o.get("joining")
                ]
                if any(o["round"] > rounds for o in running):
                    return True
                just = [o.get("committed_at") for o in running if o["round"] == rounds]
                # In their first round's reduce for over matchmaking_time (alone, it ends at twice that): a joiner
                # starting from the state before it would hardly matchmake in time, and would meet the next round
                # a round behind. It waits for that round instead; earlier in it, it tries to make it.
                late = [
                    o
                    for o in running
                    if o["round"] == rounds and o.get("busy") and o.get("since") is not None
                ]
                late = [
                    o
                    for o in late
                    if get_dht_time() - o["since"] > self._res.config.matchmaking_time
                ]
                # nobody else, or peers that start with us
                if not running or (None in just and not late):
                    return False
                periods = [
                    o["period"] for o in running if isinstance(o.get("period"), (int, float))
                ]
                if time.monotonic() - start >= max([timeout, *(2 * p for p in periods)]):
                    return False
                time.sleep(0.2)
            return False
        finally:
            self.declare(joining=False)

    def join_in_phase(self, server: StateServer, *, config: Any, stop: Any) -> None:
        """A joiner that downloaded the run's state while the swarm was training waits (bounded) for the
        swarm's next round and takes that round's state instead: it then trains its inner steps while the
        swarm trains its own, and its first round meets theirs. Called before the state is loaded."""
        meta = server.downloaded[0] if server.downloaded is not None else {}
        tag = meta.get("tag")
        if not valid_tag(tag):  # the peers run no rounds (no DiLoCo): nothing to be in phase with
            return
        timeout = deadlines(config).retries  # a round's time, as long as its reduce may retry
        if not self.wait_for_round(tag[0], timeout=timeout, stop=stop):
            return
        fresh = server.download_successor(
            (tag[0], tag[1]), timeout, stop, ready=lambda: self.ahead(tag[0], timeout=2.0)
        )
        if fresh is None or rounds_of(fresh) <= tag[0]:
            return  # keep the state downloaded first: its first round may then be a round behind (re-sync)
        values = [broadcast_values(fresh, i, tensors) for i, tensors in enumerate(server.shared)]
        for tensors, v in zip(server.shared, values):
            torch._foreach_copy_(tensors, v)
        server.downloaded = fresh
        logger.info("joined in phase: starting from the swarm's round %d", fresh[0]["tag"][0])

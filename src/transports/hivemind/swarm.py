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
- when the swarm commits its next round (``wait_for_round``): a joiner waits for it, bounded, and starts
  training from that round's state, in phase with the swarm (else its rounds and the swarm's never meet).
"""

import hashlib
import logging
import time
from typing import Any

import torch
from hivemind.utils import get_dht_time

from .deadlines import deadlines
from .resources import Resources
from .state_server import StateServer, broadcast_values
from .state_tag import valid_tag

logger = logging.getLogger(__name__)


def key_hash(key: str) -> str:
    """A reduce key as names in the DHT and p2p accept it (and as presence carries it)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class Swarm:
    """This peer's presence, and the others' as last read from the DHT."""

    def __init__(self, *, resources: Resources, key: str) -> None:
        self._res, self._key = resources, key
        self.averager: Any = None  # the state averager, which declares the presence (set once it runs)
        self._mine: dict = {"key": None, "busy": False, "round": None, "joining": False}
        self._mine.update(committed_at=None, period=None)

    def declare(self, **fields: Any) -> None:
        self._mine.update(fields)
        if self.averager is not None and not self._res.closed:
            self.averager.declare_presence(dict(self._mine))

    def committed(self, rounds: int) -> None:
        """This peer committed a round of the run state (its presence says when, and how long the last took)."""
        now, last = get_dht_time(), self._mine["committed_at"]
        self.declare(round=rounds, committed_at=now, period=None if last is None else now - last)

    def others(self, timeout: float) -> list[dict]:
        """The presence of every other live peer of the run ([] if the DHT did not answer within ``timeout``)."""
        me = self._res.dht.peer_id.to_bytes()
        try:
            got = self._res.dht.get(self._key, latest=True, return_future=True).result(timeout)
        except Exception as e:  # noqa: BLE001 - unknown: nobody is expected, matchmaking still meets whoever comes
            logger.debug("presence not read: %r", e)
            return []
        if got is None or not isinstance(got.value, dict):
            return []
        now = get_dht_time()
        return [
            v.value
            for peer, v in got.value.items()
            if peer != me and v.expiration_time > now and isinstance(v.value, dict)
        ]

    def expected(self, key: str, *, tracked: bool, timeout: float) -> int | None:
        """Peers (this one included) that a round (``tracked``) should wait for. None for any other reduce:
        not known (peers reduce key after key, in any order), so the configured ``target_group_size`` and
        ``matchmaking_time`` decide, as before."""
        if not tracked:  # presence is declared by peers that serve a run state: others may be unseen here
            return None
        return 1 + sum(o.get("round") is not None and not o.get("joining") for o in self.others(timeout))

    def wait_for_round(self, rounds: int, *, timeout: float, stop: Any) -> bool:
        """Wait until a live peer has committed more than ``rounds`` rounds (True): at most ``timeout``
        seconds, or twice the swarm's last round time if that is longer, or until ``stop()`` (False). A
        swarm that has committed no round yet starts its first one with this peer (False). Even a swarm that
        committed a moment ago is waited for: it may commit again before this peer counts as running rounds."""
        start = time.monotonic()
        self.declare(joining=True)
        try:
            while not stop():
                running = [o for o in self.others(2.0) if isinstance(o.get("round"), int) and not o.get("joining")]
                if any(o["round"] > rounds for o in running):
                    return True
                just = [o.get("committed_at") for o in running if o["round"] == rounds]
                if not running or None in just:  # nobody else, or peers that start their first round with us
                    return False
                periods = [o["period"] for o in running if isinstance(o.get("period"), (int, float))]
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
        fresh = server.download_successor((tag[0], tag[1]), timeout, stop)
        if fresh is None or fresh[0].get("prev_tag") != list(tag):
            return  # keep the state downloaded first: its first round may then be a round behind (re-sync)
        values = [broadcast_values(fresh, i, tensors) for i, tensors in enumerate(server.shared)]
        for tensors, v in zip(server.shared, values):
            torch._foreach_copy_(tensors, v)
        server.downloaded = fresh
        logger.info("joined in phase: starting from the swarm's round %d", fresh[0]["tag"][0])

"""The run's state as this peer holds it: its state tag, and taking its group's state when it is behind.

Only the results of the tracked all-reduces (the run state's keys: DiLoCo's rounds, one key per fragment) make
up the run's state; groupmates compare their tags before averaging them (``state_tag.py``). A tag counts the
reduces completed, applied or not: with overlap the run state serves the completed means still in flight.
"""

import logging
import threading
from collections.abc import Callable
from typing import NoReturn

import torch

from diloco_core.transport import StateReplaced, TransportError

from .deadlines import deadlines
from .handle import Outcome
from .hivemind_config import HivemindConfig
from .resources import Resources
from .state_server import State, StateServer, broadcast_values
from .state_tag import INITIAL_TAG, Tag, next_tag, valid_tag
from .swarm import Swarm

logger = logging.getLogger(__name__)

Loader = Callable[[dict, list[torch.Tensor]], Callable[[], None]]
"""``on_resync(extra meta, extra tensors)``: checks the run state a peer served, returns what loads it."""


def _tag_of(meta: dict, key: str) -> Tag | None:
    return None if meta.get(key) is None else (meta[key][0], meta[key][1])


class TrackedState:
    """The state tag (rounds committed, hash chain of their results) and the one before the last commit.
    Read and changed under the transport's lock."""

    def __init__(
        self, *, server: StateServer, resources: Resources, lock: threading.RLock, swarm: Swarm
    ) -> None:
        """``swarm``: the others' presence, which says when a peer has committed the round a re-sync waits for."""
        self.keys: frozenset[str] = frozenset()  # the reduce keys whose results count
        self.tag: Tag = INITIAL_TAG
        self.prev_tag: Tag | None = None
        self.on_resync: Loader | None = None
        self._server = server
        self._res = resources
        self._lock = lock
        self._swarm = swarm
        server.claims = self.claims  # a donor's claim is weighed against the swarm's (donor_choice)

    def claims(self) -> dict[bytes, int]:
        """Per live peer (id), the rounds its presence record declares ({} if the DHT does not
        answer within 2 s)."""
        got = self._swarm.others(timeout=2.0)
        rounds = {p: r.value.get("round") for p, r in got.items()}
        return {p: r for p, r in rounds.items() if type(r) is int and r >= 0}

    def track(self, keys: frozenset[str], on_resync: Loader) -> None:
        with self._lock:
            self.keys, self.on_resync = keys, on_resync

    def served(self) -> dict:
        """The tags a snapshot carries (none until an all-reduce is tracked); called under the lock."""
        tracked = bool(self.keys)
        return {
            "tag": list(self.tag) if tracked else None,
            "prev_tag": list(self.prev_tag) if tracked and self.prev_tag else None,
        }

    def commit(self, digest: bytes) -> None:
        """One more committed round whose result has ``digest``; called under the lock."""
        self.prev_tag = self.tag
        self.tag = next_tag(self.tag, digest)

    def state_dict(self) -> dict:
        with self._lock:
            return {"tag": self.tag, "prev_tag": self.prev_tag}

    def load_state_dict(self, state: dict) -> None:
        tag, prev = state.get("tag"), state.get("prev_tag")
        if not valid_tag(tag) or not (prev is None or valid_tag(prev)):
            raise ValueError(f"hivemind transport state holds no valid state tag: {state!r}")
        with self._lock:
            self.tag = (int(tag[0]), bytes(tag[1]))
            self.prev_tag = None if prev is None else (int(prev[0]), bytes(prev[1]))

    def download(self, loader: Loader, *, config: HivemindConfig, timeout: float) -> bool:
        """Download the run's state from the peers and load it with ``loader`` (a joiner: in phase with
        the swarm's rounds, maybe its next round's state, ``swarm.py``); True if one was loaded (False on
        the swarm's first peer, or where the peers shared none)."""
        if self._server.joining:
            self._server.load_state(timeout)
            self._swarm.join_in_phase(self._server, config=config, stop=lambda: self._res.closed)
        got = self._server.load_state(timeout)  # None on the swarm's first peer
        if got is None:
            return False
        if not got[0]:
            logger.warning(
                "the peers shared no DiLoCo state (they broadcast without a DiLoCo): "
                "keeping round and momentum"
            )
            return False
        loader(*got)()
        # Take the downloaded state's tag too: until now this peer served the initial tag, which no
        # group holds, so nobody re-synced from its half-loaded state.
        self.adopt(self._server.downloaded[0])
        self._server.loaded(self._server.downloaded[0])
        return True

    def adopt(self, meta: dict) -> None:
        """Take the tags of a state that was downloaded and loaded (if it has any)."""
        with self._lock:
            if meta.get("tag") is not None:
                self.tag, self.prev_tag = _tag_of(meta, "tag"), _tag_of(meta, "prev_tag")

    def catch_up(self, outcome: Outcome, *, timeout: float | None) -> None:
        """If another peer has committed the round this peer is about to contribute to, take that round's
        result (the state committed from the one this peer holds): ``StateReplaced``, in phase again."""
        with self._lock:
            tag = self.tag
        if not self._swarm.ahead(tag[0], timeout=timeout):
            return
        logger.info(
            "hivemind all_reduce: the swarm closed round %d without this peer; taking its result",
            tag[0] + 1,
        )
        try:
            self.resync(tag, outcome, timeout=self._res.config.matchmaking_time)
        except StateReplaced:
            raise
        # my state is not the one the round began from: the group's check sees to it
        except TransportError as e:
            logger.info("hivemind all_reduce: %s; matchmaking as usual", e)

    def resync(self, group_tag: Tag, outcome: Outcome, *, timeout: float | None = None) -> NoReturn:
        """Replace this peer's state with its group's, then raise ``StateReplaced``. The group is retrying
        this round without us, so wait (within one round's time) for the state it commits, whose previous
        tag is ``group_tag``: taking the group's current one would leave us a round behind again. A state
        with any other history (a peer that is stale or diverged itself) is never taken. ``timeout``: how long
        to look for it (None: a reduce's retries)."""
        if self.on_resync is None:
            raise TransportError(
                "hivemind: this peer's state is older than its group's and nothing can reload it"
            )
        timeout = deadlines(self._res.config).retries if timeout is None else timeout
        best = self._server.download_successor(
            group_tag,
            timeout,
            stop=lambda: self._res.closed or outcome.abandoned,
            ready=lambda: self._swarm.ahead(group_tag[0], timeout=2.0),
        )
        if best is None:
            raise TransportError(
                f"hivemind: this peer is behind its group (round {group_tag[0]}) and no peer served that state"
            )
        replaced = StateReplaced(
            f"this peer was behind its group; it took the group's state of round {best[0]['tag'][0]}"
        )
        load = self._loader(best, replaced)
        with self._lock:
            if outcome.abandoned or self._res.closed:
                raise TransportError("hivemind: re-sync finished after the caller had given up")
            outcome.load, outcome.replaced = load, replaced
        raise outcome.replaced

    def _loader(self, best: State, replaced: StateReplaced) -> Callable[[], None]:
        """Check everything in ``best`` now; return what loads it, which the caller's wait runs (``Handle``): in
        its own thread, so that no state changes under training that goes on while a reduce is in flight."""
        meta, got = best
        shared = self._server.shared
        values = [broadcast_values(best, index, tensors) for index, tensors in enumerate(shared)]
        load_extra = self.on_resync(meta["extra"], got[sum(meta["broadcasts"]) :])

        def load() -> None:
            with self._server.frozen, self._lock:  # in the order snapshots take them
                if self._res.closed:
                    raise TransportError(
                        "hivemind: re-sync finished after the transport was closed"
                    )
                for tensors, v in zip(shared, values):
                    torch._foreach_copy_(tensors, v)
                load_extra()
                self.tag, self.prev_tag = _tag_of(meta, "tag"), _tag_of(meta, "prev_tag")
                self._server.loaded(meta)
            self._server.take_snapshot()
            logger.warning("hivemind: %s", replaced)

        return load

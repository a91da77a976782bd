"""``HivemindTransport``: one peer of a hivemind swarm (the phases of a round: the package docstring)."""

import concurrent.futures
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diloco_core import FP32, MEAN, Codec, Merge
from diloco_core.codecs.names import check_codec
from diloco_core.membership import Membership
from diloco_core.run_state import RunState
from diloco_core.transport import (
    Capabilities,
    ReduceHandle,
    ReduceResult,
    Transport,
    TransportError,
    reduce_inputs,
)

from .attempt import commit
from .attempts import Attempts
from .auth import RunKeys, run_keys
from .averager import Averager
from .averager_pool import AveragerPool
from .deadlines import deadlines
from .faults import HivemindFaults
from .grace import RoundWindows
from .handle import Handle, Outcome
from .hivemind_config import HivemindConfig
from .quiet_logs import quiet_hivemind_records
from .requirement import import_hivemind
from .resources import Resources
from .secret import read_secret
from .state_server import StateServer
from .swarm import Swarm, key_hash
from .tracked_state import TrackedState

__all__ = ["HivemindTransport"]

logger = logging.getLogger(__name__)


class HivemindTransport(Transport, Membership):
    """A peer of a hivemind swarm (see the package docstring for the phases of a round)."""

    def __init__(
        self,
        config: HivemindConfig,
        *,
        faults: HivemindFaults | None = None,
        part_size_bytes: int = 2**19,
        keys: RunKeys | None = None,
    ) -> None:
        """``faults``: for tests, faults to inject in this peer's averagers. ``part_size_bytes``: the size of the
        parts the values travel in (hivemind's default; tests make it small to get many parts per round).
        ``keys``: for tests, the run's keys instead of those derived from ``config.secret`` (auth.py)."""
        import_hivemind()  # says how to install hivemind if it is missing
        self.config = config
        secret = read_secret(config)  # config.secret, or the file or environment variable it names
        derived, self.join_settings = run_keys(
            config.run_id, secret, joining=bool(config.initial_peers)
        )
        """Settings a joiner needs besides ``join_addresses``: the secret, where this peer generated it."""
        keys = keys or derived
        self._ns = keys.namespace
        self._res = Resources(
            config=config,
            faults=faults or HivemindFaults(),
            part_size_bytes=part_size_bytes,
            keys=keys,
        )
        self._finalizer = weakref.finalize(self, self._res.close)
        self._lock = threading.RLock()
        self._averagers = AveragerPool(self._res, namespace=self._ns)
        self._last_group: list[bytes] = []
        self._closed = False
        self._snapshot_on_commit = False
        joining = bool(config.initial_peers)
        self._server = StateServer(
            joining=joining, resources=self._res, lock=self._lock, tags=lambda: self._state.served()
        )
        self._swarm = Swarm(resources=self._res, key=keys.presence_key)
        self._state = TrackedState(
            server=self._server, resources=self._res, lock=self._lock, swarm=self._swarm
        )
        windows = RoundWindows(quorum=config.quorum_rule, matchmaking_time=config.matchmaking_time)
        self._attempts = Attempts(
            resources=self._res,
            swarm=self._swarm,
            state=self._state,
            lock=self._lock,
            windows=windows if config.quorum else None,
        )
        # in the DHT process too, which starts next (forked: it inherits the filter)
        logging.getLogger("hivemind.dht.dht").addFilter(quiet_hivemind_records)
        try:
            self._res.start_dht()
            # A 1-value averager that never averages: it serves this peer's state to joiners (a joiner
            # only once it holds the run's state).
            # It also declares this peer's presence (swarm.py).
            state_averager = self._res.start_averager(
                1,
                FP32,
                prefix=f"{self._ns}_state",
                share=not joining,
                presence_key=keys.presence_key,
            )
            state_averager.state_fn = self._server.serve
            self._server.averager = self._swarm.averager = state_averager
            self._swarm.declare()
            self._res.pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="hivemind-transport"
            )
        except BaseException:
            self._res.close()
            raise
        self.join_addresses: list[str] = [str(a) for a in self._res.dht.get_visible_maddrs()]
        """Multiaddrs to pass as ``initial_peers`` to peers that should join this one's swarm."""
        logger.info("hivemind peer up; others join with initial_peers = %s", self.join_addresses)

    # -- membership --------------------------------------------------------------------------------

    capabilities = Capabilities(
        fixed_ranks=False,  # whoever matchmakes in time forms a round's group; alone, a peer averages alone
        survives_leavers=True,
        exact_mean=False,  # casts: the mean comes back rounded to the wire dtype (block codecs: never)
        broadcast_from_any_rank=False,  # src=0 only: whoever holds the run's state
        keys_in_any_order=False,  # an averager per key, but reduces run one at a time, in call order
    )

    @property
    def own_timeout(self) -> float:  # type: ignore[override]
        """The longest one all_reduce runs by itself (``deadlines``: its retries, then one more attempt)."""
        return deadlines(self.config).own_timeout

    def attach(self, state: RunState, timeout: float) -> bool:
        """Take the run's outer momentum and round from the peers (a joiner; False on the swarm's first
        peer), then serve this peer's to later joiners (refreshed after every round) and re-sync it when
        a round finds it behind its group."""
        if self._state.on_resync is not None:
            raise ValueError(
                "this HivemindTransport already serves a DiLoCo: use one transport per DiLoCo"
            )

        def loader(meta: dict, tensors: list[torch.Tensor]) -> Callable[[], None]:
            try:
                return state.loader(meta, tensors)
            except ValueError as e:
                raise TransportError(f"hivemind: {e}") from None

        joined = self._state.download(loader, config=self.config, timeout=timeout)
        # served with the broadcast values, refreshed after every round
        self._server.extra_fn = state.snapshot
        self._server.frozen = state.lock
        # overlap: a completed reduce changes the state too
        self._snapshot_on_commit = state.means_in_flight
        state.subscribe(self._server.take_snapshot)
        # From now on groupmates compare state tags before averaging a round: a peer that is behind or has
        # diverged takes its group's state instead (checked by ``loader`` first) and its all_reduce raises
        # StateReplaced.
        self._state.track(state.keys, loader)
        self._server.take_snapshot()
        # runs rounds: counted by the others' rounds now (once the DHT has it: its first round may
        # begin next)
        self._swarm.declare(round=self._state.tag[0], wait=deadlines(self.config).presence)
        return joined

    def state_dict(self) -> dict:
        """The state tag (and the one before it), so that a peer resumed from a checkpoint is compared
        with its group by the rounds it really holds, not as a fresh start."""
        return self._state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Take back the tags of a checkpoint (DiLoCo's state is in place by now) and serve that state."""
        self._state.load_state_dict(state)
        self._swarm.declare(round=self._state.tag[0], wait=deadlines(self.config).presence)
        self._server.take_snapshot()  # joiners now get the loaded state, not the one from before it

    @property
    def _me(self) -> bytes:
        return self._res.dht.peer_id.to_bytes()

    @property
    def rank(self) -> int:
        """This peer's index in its last group (peers have no fixed rank; 0 before the first round)."""
        me = self._res.dht.peer_id.to_bytes() if self._res.dht is not None else b""
        return self._last_group.index(me) if me in self._last_group else 0

    @property
    def world_size(self) -> int:
        """Size of the last group this peer averaged in (1 before the first round)."""
        return max(1, len(self._last_group))

    # -- averaging -----------------------------------------------------------------------------------

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        codec: Codec = FP32,
        key: str = "default",
        merge: Merge = MEAN,
    ) -> ReduceHandle:
        check_codec(codec)
        tensors = reduce_inputs(tensors)
        if self._closed:
            raise TransportError("hivemind transport is closed")
        # A point between rounds: what joiners download. A joiner that takes it while this round is in
        # flight trains from it and meets this round's group if it matchmakes in time (tested); telling
        # joiners to wait instead made them miss the round and average a round behind.
        self._server.take_snapshot()
        # created here: it starts a process
        self._averagers.of(key, size=sum(t.numel() for t in tensors), codec=codec, merge=merge)
        # The caller's tensors are the contribution (untouched until commit, so a retry re-reads them).
        outcome = Outcome()
        future = self._res.pool.submit(
            self._reduce, tensors, codec=codec, key=key, merge=merge, outcome=outcome
        )
        return Handle(future, outcome, self._lock)

    def _reduce(
        self, tensors: list[torch.Tensor], *, codec: Codec, key: str, merge: Merge, outcome: Outcome
    ) -> ReduceResult:
        start = time.perf_counter()
        size = sum(t.numel() for t in tensors)
        averager = self._averagers.of(key, size=size, codec=codec, merge=merge)
        self._swarm.declare(key=key_hash(key), busy=True)
        try:
            return self._reduce_with(
                averager, tensors, codec=codec, key=key, outcome=outcome, start=start
            )
        finally:
            self._swarm.declare(busy=False)

    def _reduce_with(
        self,
        averager: Averager,
        tensors: list[torch.Tensor],
        *,
        codec: Codec,
        key: str,
        outcome: Outcome,
        start: float,
    ) -> ReduceResult:
        got = self._attempts.run(averager, tensors, key=key, outcome=outcome)
        result = self._commit(
            averager,
            tensors,
            out=got.out,
            codec=codec,
            tracked=got.tracked,
            outcome=outcome,
            start=start,
        )
        if got.window is None:
            return result
        absent = self._swarm.absent(self._last_group)  # the quorum's round closed without them
        return dataclasses.replace(result, absent=absent, grace_seconds=got.window.seconds)

    def _commit(
        self, averager: Averager, tensors: list[torch.Tensor], **kwargs: Any
    ) -> ReduceResult:
        with self._lock:
            result, self._last_group = commit(
                averager, tensors, state=self._state, me=self._me, **kwargs
            )
        if kwargs["tracked"]:
            self._swarm.committed(self._state.tag[0], self._last_group)
            # joiners get this mean with the state, and the tag that counts it
            if self._snapshot_on_commit:
                self._server.snapshot_soon()
        return result

    # -- state for joiners ---------------------------------------------------------------------------

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        """Make ``tensors`` the run's values: kept on the swarm's first peer, downloaded on a joiner."""
        if src != 0:
            raise ValueError(
                f"src={src!r} is invalid: hivemind peers have no ranks; src=0 means whoever holds the run's state"
            )
        self._server.broadcast(list(tensors), timeout)

    def close(self) -> None:
        """Shut down the averagers, then the DHT and its p2p daemon. Idempotent."""
        self._closed = True
        self._finalizer()

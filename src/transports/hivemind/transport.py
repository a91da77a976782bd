"""``HivemindTransport``: one peer of a hivemind swarm (the phases of a round: the package docstring)."""

import concurrent.futures
import hashlib
import hmac
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from diloco_core.transport import ReduceHandle, ReduceResult, Transport, TransportError
from diloco_core.wire import wire_torch_dtype

from .averager import Averager
from .config import HivemindConfig
from .diloco_state import load_diloco_state, share_diloco_state
from .faults import HivemindFaults
from .handle import Handle, Outcome
from .requirement import import_hivemind
from .resources import Resources
from .state_server import State, StateServer
from .state_tag import Stale, StaleStateError
from .tracked_state import Loader, TrackedState

__all__ = ["HivemindTransport"]

logger = logging.getLogger(__name__)

# What a group attempt raises when peers or the network fail: worth another attempt.
_RETRYABLE = (
    AllreduceException,
    MatchmakingException,
    P2PDaemonError,
    P2PHandlerError,
    TimeoutError,
    concurrent.futures.CancelledError,
)


def _namespace(run_id: str, secret: str | None) -> str:
    """The prefix of every DHT key and RPC name of the run; without the secret it cannot be guessed."""
    key = (secret or "").encode()
    return "diloco_" + hmac.new(key, run_id.encode(), hashlib.sha256).hexdigest()[:40]


class HivemindTransport(Transport):
    """A peer of a hivemind swarm (see the package docstring for the phases of a round)."""

    def __init__(
        self, config: HivemindConfig, *, faults: HivemindFaults | None = None, part_size_bytes: int = 2**19
    ) -> None:
        """``faults``: for tests, faults to inject in this peer's averagers. ``part_size_bytes``: the size of the
        parts the values travel in (hivemind's default; tests make it small to get many parts per round)."""
        import_hivemind()  # says how to install hivemind if it is missing
        if not isinstance(part_size_bytes, int) or isinstance(part_size_bytes, bool) or part_size_bytes < 1:
            raise ValueError(f"part_size_bytes={part_size_bytes!r} is invalid: expected an integer >= 1")
        self.config = config
        self._ns = _namespace(config.run_id, config.secret)
        if config.secret is None:
            logger.warning(
                "hivemind run %r has no secret: anyone who knows the run_id can join and average", config.run_id
            )
        self._res = Resources(config=config, faults=faults or HivemindFaults(), part_size_bytes=part_size_bytes)
        self._finalizer = weakref.finalize(self, self._res.close)
        self._lock = threading.RLock()  # re-entered: a re-sync loads DiLoCo, whose state_dict() reads the tags
        self._averagers: dict[tuple[int, str], Averager] = {}
        self._last_group: list[bytes] = []
        self._closed = False
        joining = bool(config.initial_peers)
        self._server = StateServer(
            joining=joining, resources=self._res, lock=self._lock, tags=lambda: self._state.served()
        )
        self._state = TrackedState(server=self._server, resources=self._res, lock=self._lock)
        try:
            self._res.start_dht()
            # A 1-value averager that never averages: it serves this peer's state to joiners (a joiner
            # only once it holds the run's state).
            state_averager = self._res.start_averager(1, "fp32", prefix=f"{self._ns}_state", share=not joining)
            state_averager.state_fn = self._server.serve
            self._server.averager = state_averager
            self._res.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hivemind-transport")
        except BaseException:
            self._res.close()
            raise
        self.join_addresses: list[str] = [str(a) for a in self._res.dht.get_visible_maddrs()]
        """Multiaddrs to pass as ``initial_peers`` to peers that should join this one's swarm."""
        logger.info("hivemind peer up; others join with initial_peers = %s", self.join_addresses)

    # -- membership --------------------------------------------------------------------------------

    fixed_ranks = False  # whoever matchmakes in time forms a round's group

    def attach(self, diloco: Any, timeout: float) -> bool:
        """Take the run's outer momentum and round from the peers (a joiner; False on the swarm's first
        peer), then serve this peer's to later joiners and re-sync it when a round finds it behind."""
        if self._state.on_resync is not None:
            raise ValueError("this HivemindTransport already serves a DiLoCo: use one transport per DiLoCo")
        joined = load_diloco_state(self, diloco, timeout)
        share_diloco_state(self, diloco)
        return joined

    def state_dict(self) -> dict:
        """The state tag (and the one before it), so that a peer resumed from a checkpoint is compared
        with its group by the rounds it really holds, not as a fresh start."""
        return self._state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Take back the tags of a checkpoint (DiLoCo's state is in place by now) and serve that state."""
        self._state.load_state_dict(state)
        self._take_snapshot()  # joiners now get the loaded state, not the one from before it

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

    def _averager(self, size: int, wire_dtype: str) -> Averager:
        key = (size, wire_dtype)
        if key not in self._averagers:
            prefix = f"{self._ns}_{wire_dtype}_{size}"
            self._averagers[key] = self._res.start_averager(size, wire_dtype, prefix=prefix)
        return self._averagers[key]

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, wire_dtype: str = "fp32") -> ReduceHandle:
        wire_torch_dtype(wire_dtype)  # every wire dtype is honoured: it picks the averager
        tensors = list(tensors)
        if not tensors:
            raise ValueError("all_reduce needs at least one tensor")
        for t in tensors:
            if t.dtype != torch.float32:
                raise ValueError(f"all_reduce takes fp32 tensors, got {t.dtype}")
        if self._closed:
            raise TransportError("hivemind transport is closed")
        # A point between rounds: what joiners download. A joiner that takes it while this round is in
        # flight trains from it and meets this round's group if it matchmakes in time (tested); telling
        # joiners to wait instead made them miss the round and average a round behind.
        self._take_snapshot()
        self._averager(sum(t.numel() for t in tensors), wire_dtype)  # created here: it starts a process
        # The caller's tensors are the contribution (untouched until commit, so a retry re-reads them).
        outcome = Outcome()
        future = self._res.pool.submit(self._reduce, tensors, wire_dtype=wire_dtype, outcome=outcome)
        return Handle(future, outcome, self._lock)

    def _reduce(self, tensors: list[torch.Tensor], *, wire_dtype: str, outcome: Outcome) -> ReduceResult:
        start = time.perf_counter()
        cfg = self.config
        numels = [t.numel() for t in tensors]
        averager = self._averager(sum(numels), wire_dtype)
        tracked = (sum(numels), wire_dtype) == self._state.key  # DiLoCo's rounds: groupmates compare state tags
        # Room for one failed attempt (up to averaging_timeout after matchmaking) and a regroup.
        deadline = time.monotonic() + cfg.averaging_timeout + 4 * cfg.matchmaking_time
        n_bytes = sum(numels) * wire_torch_dtype(wire_dtype).itemsize
        attempt = 0
        failed: Exception | None = None  # set once a group attempt failed
        while True:
            attempt += 1
            if self._res.closed or not averager.is_alive():  # step() would wait for a dead process forever
                raise TransportError("hivemind all_reduce: the transport was closed (or its averager died)")
            try:
                # Matchmaking starts first and the contribution is copied in while it runs (a group that forms
                # sooner waits for the trigger). Bounded even if the averager's process dies mid-step.
                control = averager.step(
                    gather=list(self._state.tag) if tracked else None,
                    timeout=2 * cfg.matchmaking_time,
                    allow_retries=False,
                    wait=False,
                    require_trigger=True,
                )
                try:
                    with averager.get_tensors() as (buf,):  # rounded to the wire dtype on the way in
                        for v, t in zip(buf.split(numels), tensors):  # plain copies: foreach_copy_ is 5x slower on CPU
                            v.copy_(t.detach().reshape(-1))
                    control.allow_allreduce()
                    out = self._res.wait(control, 2 * cfg.matchmaking_time + cfg.averaging_timeout + 10)
                except BaseException:
                    if not control.done():
                        control.cancel()
                    raise
            except Exception as e:
                if self._res.closed:
                    raise TransportError("hivemind transport was closed during an all_reduce") from e
                if not isinstance(e, _RETRYABLE):  # a bug or a setup error: retrying would only delay it
                    raise TransportError(f"hivemind all_reduce failed: {type(e).__name__}: {e}") from e
                out = None
                if isinstance(e, StaleStateError):  # nothing moved: the group's state tags differ
                    if e.verdict.kind is Stale.BEHIND:  # my state is older than my group's: take theirs
                        self._state.resync(e.verdict.group_tag, outcome)
                    # A groupmate is stale: retry without the stale peer(s), alone if need be.
                    if deadline - time.monotonic() < cfg.matchmaking_time:
                        raise TransportError(f"hivemind all_reduce: {e}") from e
                    logger.warning("hivemind all_reduce attempt %d: %s; retrying without them", attempt, e)
                    continue
                if "could not find a group" not in str(e):
                    failed = e
            if out is None and failed is not None:
                # After a failed group attempt a survivor never commits alone: another survivor may be
                # retrying or giving up, and only a new group (or a failure on all of them) stays consistent.
                if deadline - time.monotonic() < cfg.matchmaking_time:
                    raise TransportError(f"hivemind all_reduce failed after {attempt} attempt(s): {failed}") from failed
                logger.warning(
                    "hivemind all_reduce attempt %d failed (%s); retrying among the survivors", attempt, failed
                )
                continue
            if out is None:  # nobody to average with: my own values, as OpenDiLoCo
                logger.warning(
                    "hivemind all_reduce: no group formed within %.1fs; averaging alone", 2 * cfg.matchmaking_time
                )
                n, sent, self._last_group = 1, 0, []
            else:
                n, self._last_group = len(out["peers"]), list(out["peers"])
                sent = 2 * (n - 1) * n_bytes // n  # butterfly: my parts out, my slice's means back
            # Alone, the buffer holds my own values rounded to the wire, like every contributor's.
            with self._lock, averager.get_tensors() as (buf,):
                if outcome.abandoned:  # the caller timed out and may be retrying with these tensors
                    raise TransportError("hivemind all_reduce finished after its caller had given up")
                for r, t in zip(buf.split(numels), tensors):
                    t.copy_(r.view_as(t))
                if tracked:  # alone, my state leaves the group's: my own mark, never equal to theirs
                    me = self._res.dht.peer_id.to_bytes()
                    self._state.commit(out["digest"] if out is not None else b"alone:" + me)
                seconds = time.perf_counter() - start
                outcome.result = ReduceResult(num_contributors=n, bytes_sent=sent, bytes_received=sent, seconds=seconds)
            return outcome.result

    # -- state for joiners ---------------------------------------------------------------------------

    def share_state(self, get_state: Callable[[], State]) -> None:
        """Also serve ``get_state() -> (msgpack-able dict, tensors)`` to joiners; it is called at the start
        of every all_reduce (between rounds), so it should return tensors that are not changed in place."""
        self._server.extra_fn = get_state
        self._take_snapshot()

    def load_state(self, timeout: float) -> State | None:
        """The state a peer shared with ``share_state`` (downloaded with the broadcast values on joining);
        None when this peer started the swarm."""
        return self._server.load_state(timeout)

    def _take_snapshot(self) -> None:
        self._server.take_snapshot()

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        """Make ``tensors`` the run's values: kept on the swarm's first peer, downloaded on a joiner."""
        if src != 0:
            raise ValueError(
                f"src={src!r} is invalid: hivemind peers have no ranks; src=0 means whoever holds the run's state"
            )
        self._server.broadcast(list(tensors), timeout)

    # -- stale or diverged state ------------------------------------------------------------------------

    def track_state(self, numel: int, wire_dtype: str, on_resync: Loader) -> None:
        """Declare the all-reduce of ``numel`` values on ``wire_dtype`` as the one whose results make up the
        run's state (DiLoCo's rounds; ``share_diloco_state`` calls this). From then on groupmates compare
        state tags before averaging: a peer that is behind or has diverged takes its group's state
        instead and its ``all_reduce`` raises ``StateReplaced``. ``on_resync(extra meta, extra tensors)``
        checks what ``share_state`` served and returns the function that loads it (called after the
        broadcast values are in place), so that a state that does not fit changes nothing."""
        self._state.track((numel, wire_dtype), on_resync)
        self._take_snapshot()

    def adopt_downloaded_tag(self) -> None:
        """On a joiner, once it has loaded the state it downloaded: take that state's tag too. Until then it
        serves the initial tag, which no group holds, so nobody re-syncs from its half-loaded state."""
        self._state.adopt(self._server.downloaded[0] if self._server.downloaded is not None else {})
        self._take_snapshot()

    def close(self) -> None:
        """Shut down the averagers, then the DHT and its p2p daemon. Idempotent."""
        self._closed = True
        self._finalizer()

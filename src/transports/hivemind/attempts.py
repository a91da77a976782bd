"""A reduce's attempts: whom it waits for, how long (the configured matchmaking, or a quorum's grace window,
``grace.py``), and what each failure leads to (another attempt, taking the group's state, or averaging alone).
Phase 5, the commit, is the transport's."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from diloco_core.transport import StateReplaced, TransportError

from .attempt import RETRYABLE, attempt, fill
from .averager import Averager
from .blame import ExchangeFailed
from .deadlines import deadlines
from .grace import RoundWindows, Window
from .handle import Outcome
from .reduce_number import OutOfStepError, ReduceNumbers
from .resources import Resources
from .state_tag import Stale, StaleStateError
from .swarm import Swarm
from .tracked_state import TrackedState

__all__ = ["Attempted", "Attempts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Attempted:
    """What a reduce's attempts came to: the group's result (None: alone) and how the round was waited for."""

    out: dict[str, Any] | None
    tracked: bool
    """Whether it was a round of the run state (its groupmates compared state tags)."""
    target: int | None
    """The group size it waited for (None: not known, the configured matchmaking decided)."""
    window: Window | None
    """The grace window of its last attempt (None: no quorum)."""


class Attempts:
    """Runs a reduce's attempts until one gives a result to commit (or none can)."""

    def __init__(
        self,
        *,
        resources: Resources,
        swarm: Swarm,
        state: TrackedState,
        lock: threading.RLock,
        windows: RoundWindows | None,
    ) -> None:
        """``windows``: the grace windows of a quorum (None: every round waits the configured matchmaking)."""
        self._res, self._swarm, self._state, self._lock, self._windows = resources, swarm, state, lock, windows
        self._numbers = ReduceNumbers()  # untracked keys' calls, numbered as each reduce starts (in call order)

    def run(self, averager: Averager, tensors: list[torch.Tensor], *, key: str, outcome: Outcome) -> Attempted:
        cfg, limits = self._res.config, deadlines(self._res.config)
        tracked = key in self._state.keys  # DiLoCo's rounds: groupmates compare state tags
        # The others: numbered per averager (peers meet per averager), from this peer's state (reduce_number).
        number = None if tracked else self._numbers.take(averager.prefix, rounds=self._state.tag[0])
        # The peers this reduce waits for (swarm.py); nobody: alone at once, without matchmaking.
        expected = self._swarm.expected(key, tracked=tracked, timeout=limits.presence)
        target = self._swarm.target(expected, configured=cfg.target_group_size)
        windowed = self._windows is not None and tracked and target is not None
        window = self._windows.window(key, target=target) if windowed else None
        if window is not None:
            self._catch_up(outcome, timeout=None)  # the round closed without me (as expected() read): take its result
        elif tracked and self._swarm.behind_by_two(self._state.tag[0]):  # meeting a groupmate two rounds on
            self._catch_up(outcome, timeout=None)  # would be a tie nothing settles: take the swarm's state first
        start = time.monotonic()
        deadline = start + limits.retries  # room for one failed attempt and a regroup (deadlines)
        tries = 0
        failed: Exception | None = None  # set once a group attempt failed
        while True:
            tries += 1
            if self._res.closed or not averager.is_alive():  # step() would wait for a dead process forever
                raise TransportError("hivemind all_reduce: the transport was closed (or its averager died)")
            if outcome.abandoned:  # another attempt would feed a group values its caller has taken back
                raise TransportError("hivemind all_reduce: its caller gave up; no further attempt")
            try:
                # No other peer is at this reduce: my own values (a round with target_group_size waits
                # for it); or this peer's exchanges failed with every groupmate (blame.py): alone while
                # benched.
                waits = tracked and cfg.target_group_size and target != 1
                lone = expected == 1 and tries == 1 and not waits
                if lone or self._swarm.sits_out():
                    fill(averager, tensors)
                    why = "no other peer of the run is at it" if lone else "this peer is benched"
                    logger.info("hivemind all_reduce of %r: %s; averaging alone", key, why)
                    out = failed = None
                else:
                    gather = list(self._state.tag) if tracked else None
                    out = attempt(
                        averager,
                        tensors,
                        gather=gather,
                        number=number,
                        target=target,
                        window=window,
                        resources=self._res,
                    )
            except Exception as e:
                if self._res.closed:
                    raise TransportError("hivemind transport was closed during an all_reduce") from e
                if not isinstance(e, RETRYABLE):  # a bug or a setup error: retrying would only delay it
                    raise TransportError(f"hivemind all_reduce failed: {type(e).__name__}: {e}") from e
                out = None
                # The peers it blames: benched, the retry goes without them.
                if isinstance(e, ExchangeFailed):
                    self._swarm.bench(e.culprits, reason=str(e))
                    expected = self._swarm.expected(key, tracked=tracked, timeout=limits.presence)
                    target = self._swarm.target(expected, configured=cfg.target_group_size)
                    windowed = self._windows is not None and tracked and target is not None
                    window = self._windows.window(key, target=target) if windowed else None
                if isinstance(e, OutOfStepError) and e.verdict.behind:  # the group moved on: this call is over
                    self._numbers.catch_up(averager.prefix, e.verdict.group)
                    raise TransportError(f"hivemind all_reduce: {e}; its group has moved on") from e
                if isinstance(e, (StaleStateError, OutOfStepError)):  # nothing moved: tags or numbers differ
                    behind = isinstance(e, StaleStateError) and e.verdict.kind is Stale.BEHIND
                    if behind:  # my state is older than my group's: take theirs
                        self._state.resync(e.verdict.group_tag, outcome)
                    # A groupmate is stale: retry without the stale peer(s), alone if need be.
                    if deadline - time.monotonic() < cfg.matchmaking_time:
                        raise TransportError(f"hivemind all_reduce: {e}") from e
                    logger.warning("hivemind all_reduce attempt %d: %s; retrying without them", tries, e)
                    continue
                if "could not find a group" not in str(e):
                    failed = e
                elif window is not None and failed is None:
                    # No quorum within the window: late (the round closed: take its result) or early (wait on,
                    # as without a quorum, up to matchmaking_time; then alone).
                    self._catch_up(outcome, timeout=limits.presence)
                    if time.monotonic() - start < cfg.matchmaking_time:
                        continue
                    logger.warning("hivemind all_reduce: no quorum within %.1fs; averaging alone", cfg.matchmaking_time)
                else:
                    logger.warning(
                        "hivemind all_reduce: no group formed within %.1fs; averaging alone", limits.matchmaking
                    )
            if out is None and failed is not None:
                # After a failed group attempt a survivor never commits alone: another survivor may be
                # retrying or giving up, and only a new group (or a failure on all of them) stays consistent.
                if deadline - time.monotonic() < cfg.matchmaking_time:
                    raise TransportError(f"hivemind all_reduce failed after {tries} attempt(s): {failed}") from failed
                logger.warning(
                    "hivemind all_reduce attempt %d failed (%s); retrying among the survivors", tries, failed
                )
                continue
            if out is not None:
                self._left_me_out(out["left_out"])
            if windowed and out is not None:  # measured from the first round on
                self._windows.committed(key, group=len(out["peers"]), target=target, spread=out.get("spread"))
            return Attempted(out=out, tracked=tracked, target=target, window=window)

    def _left_me_out(self, left_out: list) -> None:
        """One WARNING line where the group's merge left this peer's own contribution out: a strong
        signal that a part's owner relayed payloads that were not its groupmates' (an insider)."""
        me = str(self._res.dht.peer_id)
        mine = [o for o in left_out if o[0] == me]
        if mine:
            logger.warning(
                "the merge left this peer's own contribution out (%s): a part's owner may have "
                "relayed payloads that are not its groupmates' (an insider), or this peer's values "
                "are far from the others'",
                mine[0][3] or f"{mine[0][1]:.3g} x the median spread",
            )

    def _catch_up(self, outcome: Outcome, *, timeout: float | None) -> None:
        """If another peer has committed the round this peer is about to contribute to, take that round's
        result (the state committed from the one this peer holds): ``StateReplaced``, in phase again."""
        with self._lock:
            tag = self._state.tag
        if not self._swarm.ahead(tag[0], timeout=timeout):
            return
        logger.info("hivemind all_reduce: the swarm closed round %d without this peer; taking its result", tag[0] + 1)
        try:
            self._state.resync(tag, outcome, timeout=self._res.config.matchmaking_time)
        except StateReplaced:
            raise
        except TransportError as e:  # my state is not the one the round began from: the group's check sees to it
            logger.info("hivemind all_reduce: %s; matchmaking as usual", e)

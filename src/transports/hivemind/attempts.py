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

from diloco_core.transport import TransportError

from .attempt import RETRYABLE, attempt, fill
from .averager import Averager
from .blame import ExchangeFailed
from .deadlines import Deadlines, deadlines
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


@dataclass(kw_only=True)
class _Plan:
    """Whom a reduce's attempt waits for (``Attempts._plan``); renewed once a peer is benched."""

    expected: int | None
    """The peers expected at it, this one included (None: not known)."""
    target: int | None
    """The group size it waits for (None: the configured matchmaking decides)."""
    windowed: bool
    """Whether a quorum's grace window bounds it."""
    window: Window | None


@dataclass(kw_only=True)
class _Loop:
    """A reduce's attempts so far (``Attempts.run``)."""

    key: str
    tracked: bool
    number: int | None
    limits: Deadlines
    plan: _Plan
    start: float
    deadline: float
    """No attempt starts without a matchmaking's worth of time left before it (monotonic)."""
    tries: int = 0
    failed: Exception | None = None
    """Set once a group attempt failed."""


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
        self._res = resources
        self._swarm = swarm
        self._state = state
        self._lock = lock
        self._windows = windows
        # untracked keys' calls, numbered as each reduce starts (in call order)
        self._numbers = ReduceNumbers()

    def run(
        self, averager: Averager, tensors: list[torch.Tensor], *, key: str, outcome: Outcome
    ) -> Attempted:
        limits = deadlines(self._res.config)
        tracked = key in self._state.keys  # DiLoCo's rounds: groupmates compare state tags
        # The others: numbered per averager (peers meet per averager), from this peer's state
        # (reduce_number).
        number = None if tracked else self._numbers.take(averager.prefix, rounds=self._state.tag[0])
        plan = self._plan(key, tracked=tracked, limits=limits)
        self._catch_up_first(outcome, tracked=tracked, window=plan.window)
        start = time.monotonic()
        loop = _Loop(
            key=key,
            tracked=tracked,
            number=number,
            limits=limits,
            plan=plan,
            start=start,
            # room for one failed attempt and a regroup (deadlines)
            deadline=start + limits.retries,
        )
        while True:
            loop.tries += 1
            self._check_can_try(averager, outcome)
            try:
                out = self._try_once(averager, tensors, loop)
            except Exception as e:  # noqa: BLE001 - _after_error raises on all but the retryable
                out = None
                if self._after_error(e, loop=loop, averager=averager, outcome=outcome):
                    continue
            if out is None and loop.failed is not None:
                self._retry_among_survivors(loop)
                continue
            return self._attempted(out, loop)

    def _plan(self, key: str, *, tracked: bool, limits: Deadlines) -> _Plan:
        """The peers this reduce waits for (swarm.py); nobody: alone at once, no matchmaking."""
        expected = self._swarm.expected(key, tracked=tracked, timeout=limits.presence)
        target = self._swarm.target(expected, configured=self._res.config.target_group_size)
        windowed = self._windows is not None and tracked and target is not None
        window = self._windows.window(key, target=target) if windowed else None
        return _Plan(expected=expected, target=target, windowed=windowed, window=window)

    def _catch_up_first(self, outcome: Outcome, *, tracked: bool, window: Window | None) -> None:
        """Before the first attempt: the result of a round the swarm closed without this peer."""
        if window is not None:
            # the round closed without me (as expected() read): take its result
            self._state.catch_up(outcome, timeout=None)
        elif tracked and self._swarm.behind_by_two(self._state.tag[0]):
            # meeting a groupmate two rounds on: a tie nothing settles; take the swarm's state first
            self._state.catch_up(outcome, timeout=None)

    def _check_can_try(self, averager: Averager, outcome: Outcome) -> None:
        """Raise where no further attempt may start."""
        # step() would wait for a dead process forever
        if self._res.closed or not averager.is_alive():
            why = "the transport was closed (or its averager died)"
            raise TransportError(f"hivemind all_reduce: {why}")
        # another attempt would feed a group values its caller has taken back
        if outcome.abandoned:
            raise TransportError("hivemind all_reduce: its caller gave up; no further attempt")

    def _try_once(
        self,
        averager: Averager,
        tensors: list[torch.Tensor],
        loop: _Loop,
    ) -> dict[str, Any] | None:
        """One attempt: the group's result, or None where this peer averages alone."""
        # No other peer is at this reduce: my own values (a round with target_group_size waits
        # for it); or this peer's exchanges failed with every groupmate (blame.py): alone while
        # benched.
        waits = loop.tracked and self._res.config.target_group_size and loop.plan.target != 1
        lone = loop.plan.expected == 1 and loop.tries == 1 and not waits
        if lone or self._swarm.sits_out():
            fill(averager, tensors)
            why = "no other peer of the run is at it" if lone else "this peer is benched"
            logger.info("hivemind all_reduce of %r: %s; averaging alone", loop.key, why)
            loop.failed = None
            return None
        gather = list(self._state.tag) if loop.tracked else None
        return attempt(
            averager,
            tensors,
            gather=gather,
            number=loop.number,
            target=loop.plan.target,
            window=loop.plan.window,
            resources=self._res,
        )

    def _after_error(
        self,
        e: Exception,
        *,
        loop: _Loop,
        averager: Averager,
        outcome: Outcome,
    ) -> bool:
        """What an attempt's error ``e`` leads to: raised on; or True: another attempt at once; or
        False: alone, unless ``loop.failed`` (then another attempt among the survivors)."""
        if self._res.closed:
            raise TransportError("hivemind transport was closed during an all_reduce") from e
        if not isinstance(e, RETRYABLE):  # a bug or a setup error: retrying would only delay it
            raise TransportError(f"hivemind all_reduce failed: {type(e).__name__}: {e}") from e
        # The peers it blames: benched, the retry goes without them.
        if isinstance(e, ExchangeFailed):
            self._swarm.bench(e.culprits, reason=str(e))
            loop.plan = self._plan(loop.key, tracked=loop.tracked, limits=loop.limits)
        if isinstance(e, OutOfStepError) and e.verdict.behind:  # the group moved on: call over
            self._numbers.catch_up(averager.prefix, e.verdict.group)
            raise TransportError(f"hivemind all_reduce: {e}; its group has moved on") from e
        if isinstance(e, (StaleStateError, OutOfStepError)):  # nothing moved: tags/numbers differ
            self._retry_without_stale(e, loop=loop, outcome=outcome)
            return True
        if "could not find a group" not in str(e):
            loop.failed = e
            return False
        return self._no_group(loop, outcome)

    def _retry_without_stale(
        self,
        e: StaleStateError | OutOfStepError,
        *,
        loop: _Loop,
        outcome: Outcome,
    ) -> None:
        """A stale groupmate, or this peer behind (it takes its group's state first): the next
        attempt goes without the stale peer(s), while a matchmaking's worth of time is left."""
        behind = isinstance(e, StaleStateError) and e.verdict.kind is Stale.BEHIND
        if behind:  # my state is older than my group's: take theirs
            self._state.resync(e.verdict.group_tag, outcome)
        # A groupmate is stale: retry without the stale peer(s), alone if need be.
        if loop.deadline - time.monotonic() < self._res.config.matchmaking_time:
            raise TransportError(f"hivemind all_reduce: {e}") from e
        logger.warning("hivemind all_reduce attempt %d: %s; retrying without them", loop.tries, e)

    def _no_group(self, loop: _Loop, outcome: Outcome) -> bool:
        """No group formed: True to try again at once (a quorum's window, early), False: alone."""
        cfg = self._res.config
        if loop.plan.window is not None and loop.failed is None:
            # No quorum within the window: late (the round closed: take its result) or early
            # (wait on, as without a quorum, up to matchmaking_time; then alone).
            self._state.catch_up(outcome, timeout=loop.limits.presence)
            if time.monotonic() - loop.start < cfg.matchmaking_time:
                return True
            logger.warning(
                "hivemind all_reduce: no quorum within %.1fs; averaging alone",
                cfg.matchmaking_time,
            )
        else:
            logger.warning(
                "hivemind all_reduce: no group formed within %.1fs; averaging alone",
                loop.limits.matchmaking,
            )
        return False

    def _retry_among_survivors(self, loop: _Loop) -> None:
        """After a failed group attempt a survivor never commits alone: another may be retrying or
        giving up, and only a new group (or a failure on all of them) stays consistent."""
        failed = loop.failed
        if loop.deadline - time.monotonic() < self._res.config.matchmaking_time:
            why = f"after {loop.tries} attempt(s): {failed}"
            raise TransportError(f"hivemind all_reduce failed {why}") from failed
        logger.warning(
            "hivemind all_reduce attempt %d failed (%s); retrying among the survivors",
            loop.tries,
            failed,
        )

    def _attempted(self, out: dict[str, Any] | None, loop: _Loop) -> Attempted:
        """What the attempts came to (its own contribution and the quorum's window seen to)."""
        plan = loop.plan
        if out is not None:
            self._left_me_out(out["left_out"])
        if plan.windowed and out is not None:  # measured from the first round on
            group, spread = len(out["peers"]), out.get("spread")
            self._windows.committed(loop.key, group=group, target=plan.target, spread=spread)
        return Attempted(out=out, tracked=loop.tracked, target=plan.target, window=plan.window)

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

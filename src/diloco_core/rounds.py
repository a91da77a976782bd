"""The round's mutable state in one owner: the counters, the global copy, the outer optimizer, the rounds in flight.

``DiLoCo``, eager updates (``eager``), checkpoints (``diloco_state``) and the run state served to joiners
(``run_state``) change it through the few operations here, never by assigning its fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .config import DiLoCoConfig
from .flat import FlatBuffer
from .fragment import Fragment
from .guard import MAX_WORK, reset_if_nonfinite
from .model_state import ModelState
from .report import PendingRound, RoundReport, log_round, report_of
from .transport import Transport

__all__ = ["Rounds"]


class Rounds:
    """The global copy (``global_copy``: the trainable tensors ``local[i]`` for i in ``order``, cut into
    ``fragments``), its outer optimizer, the counters ``round`` and ``inner_step``, and the rounds whose reduce
    is in flight (``in_flight``, in the order they began). ``model_state``'s buffers travel with the rounds,
    through ``transport``; an excluded round restarts ``inner_optimizer`` if its state is not finite. ``clock``
    (seconds) times the rounds that ``config.round_seconds`` ends by time."""

    def __init__(
        self,
        fragments: Sequence[Fragment],
        *,
        local: Sequence[torch.Tensor],
        global_copy: FlatBuffer,
        order: Sequence[int],
        outer_optimizer: torch.optim.Optimizer,
        inner_optimizer: torch.optim.Optimizer,
        model_state: ModelState,
        transport: Transport,
        config: DiLoCoConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fragments = list(fragments)
        self.global_copy = global_copy
        self.outer_optimizer = outer_optimizer
        self.local = list(local)
        self.order = list(order)
        self.ordered = [self.local[i] for i in order]
        """``local`` in the global copy's order."""
        self.inner_optimizer = inner_optimizer
        self.model_state = model_state
        self.transport = transport
        self.timeout = config.reduce_timeout
        self.merge_alpha = config.merge_alpha
        self.inner_steps, self.round_seconds, self.clock = config.inner_steps, config.round_seconds, clock
        self._round = 0
        self._inner_step = 0
        self._steps_in_round = 0  # inner steps since this worker's last round ended
        self._round_began = self._last_step = clock()
        self.ended_at: float | None = None
        """When the last round was applied, on the wall clock (``time.time()``): a peer that loads this state
        begins its round when this one's began (rounds by time)."""
        self._step_seconds = 0.0  # this worker's last inner step, on ``clock``
        self._in_flight: list[PendingRound] = []
        self._listeners: list[Callable[[], None]] = []

    @property
    def round(self) -> int:
        """Outer rounds completed (applied)."""
        return self._round

    @property
    def inner_step(self) -> int:
        """Inner steps taken."""
        return self._inner_step

    @property
    def in_flight(self) -> tuple[PendingRound, ...]:
        """The rounds begun and not yet applied, in the order they began (overlap; empty otherwise)."""
        return tuple(self._in_flight)

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The global copy, one view per ``local`` tensor."""
        views: list[torch.Tensor] = [torch.empty(0)] * len(self.local)
        for pos, i in enumerate(self.order):
            views[i] = self.global_copy.views[pos]
        return views

    @property
    def steps_in_round(self) -> int:
        """Inner steps since this worker's last round ended (or since it started, or loaded a state)."""
        return self._steps_in_round

    @property
    def work(self) -> float:
        """What this worker's next contribution weighs: its steps in the round over ``inner_steps`` where rounds
        end by time (at most ``MAX_WORK``), else 1 (every worker takes ``inner_steps`` steps per round)."""
        if self.round_seconds is None:
            return 1.0
        return min(MAX_WORK, self._steps_in_round / self.inner_steps)

    def due(self) -> bool:
        """Rounds by time: whether this worker's round ends at this step, the one that ends nearest to
        ``round_seconds`` after its last round ended (its steps taken as long as its last one): a worker
        whose steps are long arrives half a step early as often as late, and others wait a third as long."""
        assert self.round_seconds is not None
        return self._last_step - self._round_began + self._step_seconds / 2 >= self.round_seconds

    def stepped(self) -> int:
        """Count an inner step; the number taken."""
        self._inner_step += 1
        self._steps_in_round += 1
        now = self.clock()
        self._step_seconds, self._last_step = now - self._last_step, now
        return self._inner_step

    @torch.no_grad()
    def begin(self, fragment: int) -> PendingRound:
        """Phases 1-2 of a round of ``fragment``: this worker's pseudo-gradient, through the guard, and its
        reduce started (with the buffers' once per H steps, with the last fragment). Not yet in flight."""
        start = time.perf_counter()
        self.model_state.check_trainable()
        f = self.fragments[fragment]
        local_norm, excluded, clipped, sent_norm = f.pseudo_gradient()
        work = self.work
        handle, excluded = f.send(self.transport, excluded=excluded, norm=sent_norm, work=work)
        last = fragment == len(self.fragments) - 1
        return PendingRound(
            round=self._round + 1,
            handle=handle,
            pseudo_grad_norm=local_norm,
            started=start,
            buffers=self.model_state.begin(self.transport) if last else None,
            excluded=excluded,
            clipped=clipped,
            fragment=fragment,
            sent_norm=sent_norm,
            work=work,
            steps=self._steps_in_round,
        )

    @torch.no_grad()
    def finish(self, pending: PendingRound) -> RoundReport:
        """Phases 2-4 of ``pending`` (the next round, or one in flight): ``apply`` it, set the fragment's tensors
        of the model to the new global params (``merge_alpha`` of them stays local), count it."""
        if not any(p is pending for p in self._in_flight) and pending.round != self._round + 1:
            raise ValueError(f"pending round {pending.round} cannot finish: this worker is at round {self._round}")
        pending, mean_clipped, mean_norm = self.apply(pending)
        self.fragments[pending.fragment].load_global(self.merge_alpha)
        if pending.excluded:
            reset_if_nonfinite(self.inner_optimizer, self._round + 1)
        return self.advance(pending, mean_norm=mean_norm, mean_clipped=mean_clipped)

    def add(self, pending: PendingRound) -> None:
        """A round whose reduce began, to be applied later."""
        self._in_flight.append(pending)

    def drop(self, pending: PendingRound) -> None:
        """``pending`` is no longer in flight (applied, or begun again)."""
        self._in_flight = [p for p in self._in_flight if p is not pending]

    def swap(self, pending: PendingRound, **changes: Any) -> PendingRound:
        """``pending`` with ``changes`` (``dataclasses.replace``), in its place in flight if it was there."""
        new = replace(pending, **changes)
        self._in_flight = [new if p is pending else p for p in self._in_flight]
        return new

    def settle(self, pending: PendingRound) -> PendingRound:
        """Wait for a reduce in flight and put its mean in place (not yet used); idempotent."""
        if pending.settled is not None:
            return pending
        result = self.model_state.wait(pending.handle, pending.buffers, timeout=self.timeout)
        f = self.fragments[pending.fragment]
        return self.swap(pending, settled=f.settle(result, excluded=pending.excluded))

    def apply(self, pending: PendingRound) -> tuple[PendingRound, bool, float]:
        """Settle ``pending`` (it is no longer in flight) and take its fragment's outer step if any contribution
        was valid, the mean clipped by the norm guard: (``pending`` settled, mean clipped, the mean's norm)."""
        pending = self.settle(pending)
        self.drop(pending)
        fragment, settled = self.fragments[pending.fragment], pending.settled
        assert settled is not None
        mean_clipped, mean_norm = fragment.clip_mean(settled)
        if settled.valid:
            for f in self.fragments:  # SGD steps the parameters that have a gradient
                f.param.grad = f.reduce.body if f is fragment else None
            self.outer_optimizer.step()
        return pending, mean_clipped, mean_norm

    def advance(self, pending: PendingRound, *, mean_norm: float, mean_clipped: bool) -> RoundReport:
        """Count the round ``pending`` applied, tell the listeners, and log its report."""
        self._round += 1
        self.ended_at = time.time()
        self._steps_in_round, self._round_began = 0, self.clock()
        self._last_step = self._round_began
        for listener in self._listeners:
            listener()
        return log_round(report_of(pending, round=self._round, mean_norm=mean_norm, mean_clipped=mean_clipped))

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every outer round, once the new state is in place."""
        self._listeners.append(listener)

    def restore(
        self, *, round: int, inner_step: int, in_flight: Sequence[PendingRound], began_ago: float = 0.0
    ) -> None:
        """Counters and rounds in flight as loaded (a checkpoint, or a peer's run state, whose round began
        ``began_ago`` seconds ago: a round by time then ends with its peers')."""
        self._round = round
        self._inner_step = inner_step
        self._in_flight = list(in_flight)
        self._steps_in_round, self._round_began = 0, self.clock() - began_ago  # work counts from the state loaded
        self._last_step = self.clock()

    def to_model(self) -> None:
        """The model's trainable tensors become the global copy."""
        self.global_copy.copy_to(self.ordered)

    def from_model(self) -> None:
        """The global copy becomes the model's trainable tensors."""
        self.global_copy.copy_from(self.ordered)

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
from .transport import ReduceHandle, Transport

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
        self._fragments = list(fragments)
        self._global = global_copy
        self._outer = outer_optimizer
        self._local = list(local)
        self._order = list(order)
        self._ordered = [self._local[i] for i in order]  # ``local`` in the global copy's order
        self._inner = inner_optimizer
        self._model_state = model_state
        self._transport = transport
        self._timeout = config.reduce_timeout
        self._merge_alpha = config.merge_alpha
        self._inner_steps = config.inner_steps
        self._round_seconds = config.round_seconds
        self._clock = clock
        self._round = 0
        self._inner_step = 0
        self._steps_in_round = 0  # inner steps since this worker's last round ended
        self._round_began = self._last_step = clock()
        self._ended_at: float | None = None
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
        views: list[torch.Tensor] = [torch.empty(0)] * len(self._local)
        for pos, i in enumerate(self._order):
            views[i] = self._global.views[pos]
        return views

    @property
    def ended_at(self) -> float | None:
        """When the last round was applied, on the wall clock (``time.time()``): a peer that loads this
        state begins its round when this one's began (rounds by time)."""
        return self._ended_at

    @property
    def world_size(self) -> int:
        """The transport's world size now."""
        return self._transport.world_size

    @property
    def steps_in_round(self) -> int:
        """Inner steps since this worker's last round ended (or since it started, or loaded a state)."""
        return self._steps_in_round

    @property
    def work(self) -> float:
        """What this worker's next contribution weighs: its steps in the round over ``inner_steps`` where rounds
        end by time (at most ``MAX_WORK``), else 1 (every worker takes ``inner_steps`` steps per round)."""
        if self._round_seconds is None:
            return 1.0
        return min(MAX_WORK, self._steps_in_round / self._inner_steps)

    def due(self) -> bool:
        """Rounds by time: whether this worker's round ends at this step, the one that ends nearest to
        ``round_seconds`` after its last round ended (its steps taken as long as its last one): a worker
        whose steps are long arrives half a step early as often as late, and others wait a third as long."""
        assert self._round_seconds is not None
        return self._last_step - self._round_began + self._step_seconds / 2 >= self._round_seconds

    def stepped(self) -> int:
        """Count an inner step; the number taken."""
        self._inner_step += 1
        self._steps_in_round += 1
        now = self._clock()
        self._step_seconds, self._last_step = now - self._last_step, now
        return self._inner_step

    @torch.no_grad()
    def begin(self, fragment: int) -> PendingRound:
        """Phases 1-2 of a round of ``fragment``: this worker's pseudo-gradient, through the guard, and its
        reduce started (with the buffers' once per H steps, with the last fragment). Not yet in flight."""
        start = time.perf_counter()
        self._model_state.check_trainable()
        f = self._fragments[fragment]
        local_norm, excluded, clipped, sent_norm = f.pseudo_gradient()
        work = self.work
        last = fragment == len(self._fragments) - 1
        handle, excluded, buffers = self.send(fragment, excluded=excluded, norm=sent_norm, work=work, buffers=last)
        return PendingRound(
            round=self._round + 1,
            handle=handle,
            pseudo_grad_norm=local_norm,
            started=start,
            buffers=buffers,
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
        self._fragments[pending.fragment].load_global(self._merge_alpha)
        if pending.excluded:
            self.restart_inner_if_nonfinite()
        return self.advance(pending, mean_norm=mean_norm, mean_clipped=mean_clipped)

    def send(
        self, fragment: int, *, excluded: bool, norm: float, work: float = 1.0, buffers: bool = True
    ) -> tuple[ReduceHandle, bool, ReduceHandle | None]:
        """Start the reduce of ``fragment``'s body (``Fragment.send``) and, if ``buffers``, the model's
        buffers': (the handle, excluded, the buffers' handle; None: not started or none)."""
        handle, excluded = self._fragments[fragment].send(self._transport, excluded=excluded, norm=norm, work=work)
        return handle, excluded, self._model_state.begin(self._transport) if buffers else None

    def restart_inner_if_nonfinite(self) -> None:
        """After an excluded contribution: restart the inner optimizer if its state is not finite."""
        reset_if_nonfinite(self._inner, self._round + 1)

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
        result = self._model_state.wait(pending.handle, pending.buffers, timeout=self._timeout)
        f = self._fragments[pending.fragment]
        return self.swap(pending, settled=f.settle(result, excluded=pending.excluded))

    def apply(self, pending: PendingRound) -> tuple[PendingRound, bool, float]:
        """Settle ``pending`` (it is no longer in flight) and take its fragment's outer step if any contribution
        was valid, the mean clipped by the norm guard: (``pending`` settled, mean clipped, the mean's norm)."""
        pending = self.settle(pending)
        self.drop(pending)
        fragment, settled = self._fragments[pending.fragment], pending.settled
        assert settled is not None
        mean_clipped, mean_norm = fragment.clip_mean(settled)
        if settled.valid:
            for f in self._fragments:  # SGD steps the parameters that have a gradient
                f.param.grad = f.reduce.body if f is fragment else None
            self._outer.step()
        return pending, mean_clipped, mean_norm

    def advance(self, pending: PendingRound, *, mean_norm: float, mean_clipped: bool) -> RoundReport:
        """Count the round ``pending`` applied, tell the listeners, and log its report."""
        self._round += 1
        self._ended_at = time.time()
        self._steps_in_round, self._round_began = 0, self._clock()
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
        self._steps_in_round, self._round_began = 0, self._clock() - began_ago  # work counts from the state loaded
        self._last_step = self._clock()

    def state_dict(self) -> dict[str, Any]:
        """The model (trainable tensors, their names, its other state), the global copy, both optimizers
        and the counters, as ``DiLoCo.state_dict()`` holds them."""
        return {
            "model": [p.detach() for p in self._local],
            "param_names": list(self._model_state.names),
            "model_state": self._model_state.state_dict(),
            "global": self._global.flat,
            "outer_optimizer": self._outer.state_dict(),
            "inner_optimizer": self._inner.state_dict(),
            "inner_step": self._inner_step,
            "round": self._round,
        }

    def check_loadable(self, state: dict[str, Any]) -> None:
        """``ValueError`` if a ``state_dict()`` does not fit this model (nothing changes)."""
        model, flat = state["model"], state["global"]
        shapes = [tuple(t.shape) for t in model]
        here = [tuple(t.shape) for t in self._local]
        if shapes != here or flat.shape != self._global.flat.shape:
            raise ValueError(
                f"DiLoCo state holds {len(shapes)} tensors ({flat.numel()} values); this model has "
                f"{len(here)} ({self._global.flat.numel()} values)"
            )
        self._model_state.check_loadable(state)

    def load_state_dict(self, state: dict[str, Any], *, in_flight: Sequence[PendingRound]) -> None:
        """Load a ``state_dict()`` that passed ``check_loadable``, with the rounds ``in_flight``."""
        torch._foreach_copy_(self._local, list(state["model"]))
        self._global.flat.copy_(state["global"])
        self._model_state.load(state)
        self._outer.load_state_dict(state["outer_optimizer"])
        self._inner.load_state_dict(state["inner_optimizer"])
        self.restore(round=int(state["round"]), inner_step=int(state["inner_step"]), in_flight=in_flight)

    def momentum(self) -> list[torch.Tensor]:
        """A copy of the outer optimizer's momentum, one buffer per fragment (none before round 1)."""
        state = self._outer.state_dict()["state"].values()
        return [s["momentum_buffer"].clone() for s in state if s.get("momentum_buffer") is not None]

    def load_momentum(self, buffers: Sequence[torch.Tensor]) -> None:
        """The outer optimizer's momentum becomes a copy of ``buffers`` (one per fragment, or none)."""
        state = self._outer.state_dict()
        keys = state["param_groups"][0]["params"]
        state["state"] = {k: {"momentum_buffer": t.clone()} for k, t in zip(keys, buffers)}
        self._outer.load_state_dict(state)

    def global_clone(self) -> torch.Tensor:
        """A copy of the global copy's flat tensor."""
        return self._global.flat.detach().clone()

    def to_model(self) -> None:
        """The model's trainable tensors become the global copy."""
        self._global.copy_to(self._ordered)

    def from_model(self) -> None:
        """The global copy becomes the model's trainable tensors."""
        self._global.copy_from(self._ordered)

"""DiLoCo: H local inner steps, then one averaged outer step on a shared global copy."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .agreement import check_settings, settings_of
from .codecs.names import codec_of
from .config import DiLoCoConfig, outer_lr_of
from .diloco_state import load_state, state_of
from .eager import Eager
from .flat import FlatBuffer, local_of
from .fragment import cut
from .membership import Membership
from .model_state import ModelState
from .report import PendingRound, RoundReport
from .rounds import Rounds
from .run_state import RunState
from .streaming import begins_at, strided_fragments, user_fragments
from .transport import StateReplaced, Transport, TransportError, check_own_timeout

__all__ = ["DiLoCo", "PendingRound", "RoundReport"]

logger = logging.getLogger(__name__)


class DiLoCo:
    """Wraps a model and its inner optimizer; every ``inner_steps``-th ``step()`` runs an outer round (with
    ``config.round_seconds``: the first ``step()`` that many seconds after the last round, docs/elastic.md).

    All ranks construct it collectively: it checks that every rank's model has the same entries (names,
    shapes, dtypes), then makes every rank start from rank 0's weights, frozen parameters and buffers
    (``ModelState``: floating-point buffers are also averaged every round). Call ``step()`` after ``backward()``;
    zeroing gradients stays the caller's. An outer round has four phases:

    1. pseudo-gradient: ``global - local`` (old minus new), in fp32 on ``global_device``;
    2. mean of the pseudo-gradients over the contributors, through the transport, travelling as
       ``codec`` and summed in fp32;
    3. outer step: ``torch.optim.SGD`` (Nesterov) on the global copy, the mean used as its gradient;
    4. the new global params are copied into the model, and inner training resumes from them.

    The phases and the state they change (counters, global copy, outer optimizer, rounds in flight) are
    ``rounds`` (``diloco_core.rounds.Rounds``); ``DiLoCo`` schedules them, retries them and answers for them.

    If phase 2 raises ``TransportError`` nothing has changed: the global copy and the outer optimizer
    are as before and the model keeps its local params. ``step()`` retries the round up to
    ``round_retries`` times (survivors of a lost peer regroup), then lets the error through; the caller
    may call ``sync()`` again later. If it raises ``StateReplaced`` (this worker was behind its group and
    the transport loaded the group's state into it), ``step()`` returns None and training goes on.
    The inner optimizer's state is kept across rounds and never communicated.

    Overlap (``config.overlap``, docs/overlap.md): ``streaming`` cuts the model into ``fragments`` synced one
    after another (``diloco_core.streaming``), each reduce running behind ``overlap_steps`` inner steps;
    ``eager`` runs each round's reduce behind the next ``inner_steps`` (``diloco_core.eager``). Call
    ``flush()`` at the end of training to apply what is still in flight; the blocking ``sync()``,
    ``begin_round()`` and ``finish_round()`` refuse to run beside it.

    FSDP2 islands: a model sharded by ``fully_shard`` has DTensor parameters; DiLoCo works on each one's
    local shard (``local``), so its transport's group must be the ranks holding the same shards, one per
    island (``transports.islands.island_transport`` builds it from a DeviceMesh and checks the layout).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        transport: Transport,
        config: DiLoCoConfig,
        *,
        fragments: Sequence[Sequence[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``fragments`` (streaming): each fragment's trainable parameter names, instead of strided blocks.
        ``clock``: the seconds that ``config.round_seconds`` ends rounds by (tests give their own)."""
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.transport = transport
        self.config = config
        check_own_timeout(transport, config.reduce_timeout)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.local = [local_of(p) for p in self.params]
        """What this rank holds of ``params``: each DTensor's local shard (FSDP2), else the parameter itself."""
        if config.rda and any(t is not p for t, p in zip(self.local, self.params)):
            raise ValueError("rda=True needs each tensor's whole norm, but FSDP2 islands hold shards: set rda=False")
        self.model_state = ModelState(model, self.params, config.global_device)
        """The model's entries by name, its frozen parameters and buffers (synchronized and checkpointed)."""
        self.codec = codec_of(config)
        """How pseudo-gradients travel (``config.codec`` names it)."""
        names = self.model_state.names
        groups = (
            user_fragments(names, fragments, config.fragments)
            if fragments is not None
            else strided_fragments(model, self.params, config.fragments)
        )
        order = [i for g in groups for i in g]  # the global copy holds the fragments one after another
        global_copy = FlatBuffer([self.local[i] for i in order], config.global_device)
        self.codec.prepare(global_copy.flat, payloads=(2, transport.world_size))  # its kernels: not in a round
        fixed = transport.capabilities.fixed_ranks
        self.fragments = cut(groups, self.local, global_copy, codec=self.codec, config=config, compare=fixed)
        """The parts synchronized on their own, each a slice of the global copy (one unless streaming)."""
        self.guard = self.fragments[0].guard
        """The first fragment's contribution guard (``diloco_core.guard``; the only one unless streaming)."""
        self.outer_lr = outer_lr_of(config, world_size=transport.world_size, fixed_ranks=fixed)
        """The outer SGD's learning rate: ``config.outer_lr``, or the rule's for the world size (eager: for 1)."""
        outer = {
            "lr": self.outer_lr,
            "momentum": config.outer_momentum,
            "nesterov": config.nesterov and config.outer_momentum > 0,
        }
        # fused: one pass over the flat buffer instead of three (and no temporary the size of the model)
        self.outer_optimizer = torch.optim.SGD([f.param for f in self.fragments], **outer, fused=True)
        self.rounds = Rounds(
            self.fragments,
            local=self.local,
            global_copy=global_copy,
            order=order,
            outer_optimizer=self.outer_optimizer,
            inner_optimizer=inner_optimizer,
            model_state=self.model_state,
            transport=transport,
            config=config,
            clock=clock,
        )
        self.outer_seconds = 0.0
        """Seconds the last ``step()`` spent on outer rounds (what training waited for; 0: none due)."""
        with torch.no_grad():
            settings = settings_of(config, codec=self.codec, outer_lr=self.outer_lr, fragments=self.fragments)
            check_settings(transport, settings, timeout=config.reduce_timeout, device=global_copy.flat.device)
            self.model_state.check_same(transport, config.reduce_timeout)
            self.rounds.from_model()
            self.model_state.broadcast(transport, global_copy.flat, timeout=config.reduce_timeout)
            self.rounds.to_model()
        self.eager = Eager(self.rounds, fragment=self.fragments[0], outer=outer) if config.overlap == "eager" else None
        """Eager updates' own outer parameters and share in flight (``diloco_core.eager``); None otherwise."""
        self.run_state = RunState(self.rounds, config, fragments=self.fragments, eager=self.eager)
        """The outer state a transport whose peers come and go serves to joiners (``Membership.attach``)."""
        self.joined = isinstance(transport, Membership) and transport.attach(self.run_state, config.reduce_timeout)
        """True if this worker joined a run already going: global params, outer momentum and round came
        from its peers (only a ``Membership`` does that; a fixed group's transport is not attached)."""

    @property
    def reduce_numel(self) -> int:
        """Values a worker sends per H steps: pseudo-gradient, zeros up to a codec block, the guard's tail (per fragment)."""
        return sum(f.reduce.flat.numel() for f in self.fragments)

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The fp32 global copy, one view per trainable parameter's ``local`` tensor (read only, please)."""
        return self.rounds.global_params

    @property
    def round(self) -> int:
        """Outer rounds applied so far."""
        return self.rounds.round

    @property
    def inner_step(self) -> int:
        """Inner steps taken so far."""
        return self.rounds.inner_step

    @property
    def in_flight(self) -> tuple[PendingRound, ...]:
        """The rounds whose reduce is in flight, in the order they began (overlap; ``flush()`` applies them)."""
        return self.rounds.in_flight

    def step(self) -> RoundReport | None:
        """Step the inner optimizer; at the steps the overlap mode says, begin or finish an outer round
        (``none``: every ``inner_steps``-th step runs a whole round)."""
        self.inner_optimizer.step()
        step = self.rounds.stepped()
        start = time.perf_counter()
        with self.run_state.boundary(step):  # a transport may snapshot it from its own thread
            report = self._outer(step, self.config)
        self.outer_seconds = time.perf_counter() - start
        return report

    def _outer(self, s: int, c: DiLoCoConfig) -> RoundReport | None:
        if c.round_seconds is not None:  # elastic: by this worker's clock, whatever its steps (overlap is none)
            due = self.rounds.due()
            return self._with_retries(lambda retry: self.rounds.finish(self.rounds.begin(0))) if due else None
        if self.eager is not None:
            eager, w = self.eager, c.eager_fresh_weight
            return None if s % c.inner_steps else self._with_retries(lambda retry: eager.boundary(retry, w))
        report = None
        for fragment in [p.fragment for p in self.rounds.in_flight if p.finish_at == s]:
            report = self._with_retries(lambda retry, fragment=fragment: self._finish_scheduled(fragment, retry))
        p = begins_at(s, inner_steps=c.inner_steps, fragments=len(self.fragments))
        if p is not None and c.overlap_steps == 0:
            report = self._with_retries(lambda retry: self.rounds.finish(self.rounds.begin(p)))
        elif p is not None:
            self.rounds.add(replace(self.rounds.begin(p), finish_at=s + c.overlap_steps))
        return report

    def _with_retries(self, run: Callable[[bool], RoundReport]) -> RoundReport | None:
        """``run(retry)``, again (``retry=True``) after a ``TransportError``, up to ``round_retries`` times."""
        for attempt in range(self.config.round_retries + 1):
            try:
                return run(attempt > 0)
            except StateReplaced as e:  # the transport loaded the group's state: nothing to retry
                logger.warning("this round was dropped (%s); continuing from round %d", e, self.rounds.round)
                return None
            except TransportError as e:
                if attempt == self.config.round_retries:
                    raise
                logger.warning(
                    "round %d failed (%s); retrying (%d of %d)",
                    self.rounds.round + 1,
                    e,
                    attempt + 1,
                    self.config.round_retries,
                )
        raise AssertionError("unreachable")

    def _finish_scheduled(self, fragment: int, retry: bool) -> RoundReport:
        """A streamed fragment's outer step, ``overlap_steps`` after its reduce began; a retry after its reduce
        failed takes its pseudo-gradient afresh and waits for it (every worker retries at the same step)."""
        pending = next(p for p in self.rounds.in_flight if p.fragment == fragment)
        if retry and pending.settled is None:
            self.rounds.drop(pending)
            pending = self.rounds.begin(fragment)
        return self.rounds.finish(pending)

    def _blocking(self, call: str) -> None:
        if self.config.overlap != "none":
            raise RuntimeError(
                f"{call}() runs a blocking round of the whole model, but overlap={self.config.overlap!r} schedules "
                "its own rounds: call step() (it begins and finishes them) and flush() at the end of training"
            )

    def sync(self) -> RoundReport:
        """Run one outer round of the whole model now (blocking): ``begin_round`` + ``finish_round``.
        ``RuntimeError`` unless ``overlap`` is ``none`` (call ``step()`` and ``flush()`` there)."""
        self._blocking("sync")
        return self.rounds.finish(self.rounds.begin(0))

    def begin_round(self, fragment: int = 0) -> PendingRound:
        """Phases 1-2 of a round of ``fragment``: compute this worker's pseudo-gradient and start its reduce.
        The model may train on meanwhile (the reduce reads a copy); nothing else changes until
        ``finish_round``. A pseudo-gradient the guard refuses (NaN, infinite, out of the wire's range) is sent
        as zeros, flagged not valid (``diloco_core.guard``). ``RuntimeError`` unless ``overlap`` is ``none``."""
        self._blocking("begin_round")
        return self.rounds.begin(fragment)

    def finish_round(self, pending: PendingRound) -> RoundReport:
        """Phases 2-4: wait for the mean, take the fragment's outer step, and set the fragment's tensors of the
        model to the new global params (streaming: ``merge_alpha`` of them stays local). If the reduce raises
        ``TransportError`` nothing has changed (call ``begin_round`` again). ``RuntimeError`` unless ``overlap``
        is ``none``."""
        self._blocking("finish_round")
        return self.rounds.finish(pending)

    @torch.no_grad()
    def flush(self) -> None:
        """Complete every reduce in flight and apply it (streaming: as if its ``overlap_steps`` had passed;
        eager: ``Eager.flush``). Call it at the end of training; without overlap, nothing is in flight."""
        with self.run_state.lock:
            if self.eager is not None:
                self.eager.flush()
            for pending in self.rounds.in_flight:
                self.rounds.finish(pending)

    def state_dict(self) -> dict[str, Any]:
        """All needed to continue bit-identically (``diloco_state``); reduces in flight settle, kept for their step."""
        with self.run_state.lock:
            kept = self.transport.state_dict() if isinstance(self.transport, Membership) else {}  # a fixed group: none
            return {**state_of(self.rounds, self.fragments, self.eager), "transport": kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.run_state.lock:
            load_state(self.rounds, state, fragments=self.fragments, eager=self.eager)
            if isinstance(self.transport, Membership):
                self.transport.load_state_dict(state["transport"])

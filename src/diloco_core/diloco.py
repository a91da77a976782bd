"""DiLoCo: H local inner steps, then one averaged outer step on a shared global copy."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .agreement import check_settings, settings_of
from .codecs.names import codec_for
from .config import DiLoCoConfig, outer_lr_for
from .diloco_state import load_state, state_of
from .eager import Eager, eager_flush, eager_round
from .flat import FlatBuffer, local_of
from .fragment import Fragment, cut
from .guard import reset_if_nonfinite
from .model_state import ModelState
from .report import PendingRound, RoundReport, log_round, report_of
from .run_state import RunState
from .streaming import begins_at, strided_fragments, user_fragments
from .transport import StateReplaced, Transport, TransportError

__all__ = ["DiLoCo", "PendingRound", "RoundReport"]

logger = logging.getLogger(__name__)


class DiLoCo:
    """Wraps a model and its inner optimizer; every ``inner_steps``-th ``step()`` runs an outer round.

    All ranks construct it collectively: it checks that every rank's model has the same entries (names,
    shapes, dtypes), then makes every rank start from rank 0's weights, frozen parameters and buffers
    (``ModelState``: floating-point buffers are also averaged every round). Call ``step()`` after ``backward()``;
    zeroing gradients stays the caller's. An outer round has four phases:

    1. pseudo-gradient: ``global - local`` (old minus new), in fp32 on ``global_device``;
    2. mean of the pseudo-gradients over the contributors, through the transport, travelling as
       ``codec`` and summed in fp32;
    3. outer step: ``torch.optim.SGD`` (Nesterov) on the global copy, the mean used as its gradient;
    4. the new global params are copied into the model, and inner training resumes from them.

    If phase 2 raises ``TransportError`` nothing has changed: the global copy and the outer optimizer
    are as before and the model keeps its local params. ``step()`` retries the round up to
    ``round_retries`` times (survivors of a lost peer regroup), then lets the error through; the caller
    may call ``sync()`` again later. If it raises ``StateReplaced`` (this worker was behind its group and
    the transport loaded the group's state into it), ``step()`` returns None and training goes on.
    The inner optimizer's state is kept across rounds and never communicated.

    Overlap (``config.overlap``, docs/overlap.md): ``streaming`` cuts the model into ``fragments`` synced one
    after another (``diloco_core.streaming``), each reduce running behind ``overlap_steps`` inner steps;
    ``eager`` runs each round's reduce behind the next ``inner_steps`` (``diloco_core.eager``). Call
    ``flush()`` at the end of training to apply what is still in flight.

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
    ) -> None:
        """``fragments`` (streaming): each fragment's trainable parameter names, instead of strided blocks."""
        self.model, self.inner_optimizer, self.transport, self.config = model, inner_optimizer, transport, config
        own = transport.own_timeout
        if own is not None and own > config.reduce_timeout:
            raise ValueError(
                f"reduce_timeout={config.reduce_timeout:g} is shorter than the transport's own timeout ({own:g}s): "
                f"the core would give up on reduces the transport still runs; set reduce_timeout >= {own:g} "
                "or lower the transport's timeout"
            )
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.local = [local_of(p) for p in self.params]
        """What this rank holds of ``params``: each DTensor's local shard (FSDP2), else the parameter itself."""
        self.model_state = ModelState(model, self.params, config.global_device)
        """The model's entries by name, its frozen parameters and buffers (synchronized and checkpointed)."""
        self.inner_step, self.round = 0, 0
        self.codec = codec_for(config.codec, config.codec_block)
        """How pseudo-gradients travel (``config.codec`` names it)."""
        names = self.model_state.names
        groups = (
            user_fragments(names, fragments, config.fragments)
            if fragments is not None
            else strided_fragments(model, self.params, config.fragments)
        )
        self._order = [i for g in groups for i in g]  # the global copy holds the fragments one after another
        self._global = FlatBuffer([self.local[i] for i in self._order], config.global_device)
        self.codec.prepare(self._global.flat, payloads=(2, transport.world_size))  # its kernels: not in a round
        self.fragments = cut(
            groups, self.local, self._global, codec=self.codec, config=config, compare=transport.fixed_ranks
        )
        """The parts synchronized on their own, each a slice of the global copy (one unless streaming)."""
        self.guard = self.fragments[0].guard
        """The first fragment's contribution guard (``diloco_core.guard``; the only one unless streaming)."""
        momentum = config.outer_momentum
        rule_m = 1 if config.overlap == "eager" else transport.world_size  # eager: M's share of each step lags
        self.outer_lr = config.outer_lr if config.outer_lr is not None else outer_lr_for(rule_m, momentum)
        """The outer SGD's learning rate: ``config.outer_lr``, or the rule's for the world size (eager: for 1)."""
        if config.outer_lr is None and not transport.fixed_ranks:
            logger.warning(
                "outer_lr is unset and the transport's peers come and go: using %.3g, the rule's value "
                "for %d worker(s); set outer_lr for the number you expect",
                self.outer_lr,
                transport.world_size,
            )
        nesterov = config.nesterov and momentum > 0
        self.outer_optimizer = torch.optim.SGD(
            [f.param for f in self.fragments],
            lr=self.outer_lr,
            momentum=momentum,
            nesterov=nesterov,
            fused=True,  # one pass over the flat buffer instead of three (and no temporary the size of the model)
        )
        self._pending: list[PendingRound] = []  # reduces in flight (overlap), in the order they began
        self.run_state = RunState(self)
        """The outer state a transport whose peers come and go serves to joiners (``Transport.attach``)."""
        self.outer_seconds = 0.0
        """Seconds the last ``step()`` spent on outer rounds (what training waited for; 0: none due)."""
        with torch.no_grad():
            check_settings(transport, settings_of(self), timeout=config.reduce_timeout, device=self._global.flat.device)
            self.model_state.check_same(transport, config.reduce_timeout)
            self._global.copy_from([self.local[i] for i in self._order])
            self.model_state.before_broadcast()
            transport.broadcast([self._global.flat, *self.model_state.shared], src=0, timeout=config.reduce_timeout)
            self._global.copy_to([self.local[i] for i in self._order])
            self.model_state.after_broadcast()
        self.eager = (
            Eager(self._global.flat, lr=self.outer_lr, momentum=momentum, nesterov=nesterov)
            if config.overlap == "eager"
            else None
        )
        """Eager updates' own outer parameters and share in flight (``diloco_core.eager``); None otherwise."""
        self.joined = transport.attach(self.run_state, timeout=config.reduce_timeout)
        """True if this worker joined a run already going: global params, outer momentum and round came
        from its peers (only transports whose peers come and go do that)."""

    @property
    def reduce_numel(self) -> int:
        """Values a worker sends per H steps: pseudo-gradient, zeros up to a codec block, the guard's tail (per fragment)."""
        return sum(f.reduce.flat.numel() for f in self.fragments)

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The fp32 global copy, one view per trainable parameter's ``local`` tensor (read only, please)."""
        views: list[torch.Tensor] = [torch.empty(0)] * len(self.local)
        for pos, i in enumerate(self._order):
            views[i] = self._global.views[pos]
        return views

    def step(self) -> RoundReport | None:
        """Step the inner optimizer; at the steps the overlap mode says, begin or finish an outer round
        (``none``: every ``inner_steps``-th step runs a whole round)."""
        self.inner_optimizer.step()
        self.inner_step += 1
        start = time.perf_counter()
        with self.run_state.boundary(self.inner_step):  # a transport may snapshot it from its own thread
            report = self._outer(self.inner_step, self.config)
        self.outer_seconds = time.perf_counter() - start
        return report

    def _outer(self, s: int, c: DiLoCoConfig) -> RoundReport | None:
        if c.overlap == "eager":
            return None if s % c.inner_steps else self._with_retries(lambda retry: eager_round(self, retry))
        report = None
        for fragment in [p.fragment for p in self._pending if p.finish_at == s]:
            report = self._with_retries(lambda retry, fragment=fragment: self._finish_scheduled(fragment, retry))
        p = begins_at(s, inner_steps=c.inner_steps, fragments=len(self.fragments))
        if p is not None and c.overlap_steps == 0:
            report = self._with_retries(lambda retry: self.finish_round(self.begin_round(fragment=p)))
        elif p is not None:
            self._pending.append(replace(self.begin_round(fragment=p), finish_at=s + c.overlap_steps))
        return report

    def _with_retries(self, run: Callable[[bool], RoundReport]) -> RoundReport | None:
        """``run(retry)``, again (``retry=True``) after a ``TransportError``, up to ``round_retries`` times."""
        for attempt in range(self.config.round_retries + 1):
            try:
                return run(attempt > 0)
            except StateReplaced as e:  # the transport loaded the group's state: nothing to retry
                logger.warning("this round was dropped (%s); continuing from round %d", e, self.round)
                return None
            except TransportError as e:
                if attempt == self.config.round_retries:
                    raise
                logger.warning(
                    "round %d failed (%s); retrying (%d of %d)",
                    self.round + 1,
                    e,
                    attempt + 1,
                    self.config.round_retries,
                )
        raise AssertionError("unreachable")

    def _finish_scheduled(self, fragment: int, retry: bool) -> RoundReport:
        """A streamed fragment's outer step, ``overlap_steps`` after its reduce began; a retry after its reduce
        failed takes its pseudo-gradient afresh and waits for it (every worker retries at the same step)."""
        pending = next(p for p in self._pending if p.fragment == fragment)
        if retry and pending.settled is None:
            self._pending = [p for p in self._pending if p is not pending]
            pending = self.begin_round(fragment=fragment)
        return self.finish_round(pending)

    @torch.no_grad()
    def sync(self) -> RoundReport:
        """Run one outer round of the first fragment now (blocking: the whole model): ``begin_round`` +
        ``finish_round``."""
        return self.finish_round(self.begin_round())

    @torch.no_grad()
    def begin_round(self, fragment: int = 0) -> PendingRound:
        """Phases 1-2 of a round of ``fragment``: compute this worker's pseudo-gradient and start its reduce.
        The model may train on meanwhile (the reduce reads a copy); nothing else changes until
        ``finish_round``. A pseudo-gradient the guard refuses (NaN, infinite, out of the wire's range) is sent
        as zeros, flagged not valid (``diloco_core.guard``)."""
        start = time.perf_counter()
        self.model_state.check_trainable()
        f = self.fragments[fragment]
        local_norm, excluded, clipped, sent_norm = f.pseudo_gradient()
        handle, excluded = f.send(self.transport, excluded=excluded, norm=sent_norm)
        last = fragment == len(self.fragments) - 1  # the buffers travel once per H steps, with the last fragment
        buffers = self.model_state.begin(self.transport) if last else None
        return PendingRound(
            round=self.round + 1,
            handle=handle,
            pseudo_grad_norm=local_norm,
            started=start,
            buffers=buffers,
            excluded=excluded,
            clipped=clipped,
            fragment=fragment,
            sent_norm=sent_norm,
        )

    def _settle(self, pending: PendingRound) -> PendingRound:
        """Wait for a reduce in flight and put its mean in place (not yet used); idempotent."""
        if pending.settled is not None:
            return pending
        result = self.model_state.wait(pending.handle, pending.buffers, timeout=self.config.reduce_timeout)
        settled = replace(pending, settled=self.fragments[pending.fragment].settle(result, excluded=pending.excluded))
        self._pending = [settled if p is pending else p for p in self._pending]
        return settled

    @torch.no_grad()
    def finish_round(self, pending: PendingRound) -> RoundReport:
        """Phases 2-4: wait for the mean, take the fragment's outer step, and set the fragment's tensors of the
        model to the new global params (streaming: ``merge_alpha`` of them stays local). If the reduce raises
        ``TransportError`` nothing has changed (call ``begin_round`` again)."""
        if not any(p is pending for p in self._pending) and pending.round != self.round + 1:
            raise ValueError(f"pending round {pending.round} cannot finish: this worker is at round {self.round}")
        pending = self._settle(pending)
        self._pending = [p for p in self._pending if p is not pending]
        f, settled = self.fragments[pending.fragment], pending.settled
        assert settled is not None
        mean_clipped, mean_norm = f.clip_mean(settled)
        if settled.valid:
            self._outer_step(f)
        f.load_global(self.config.merge_alpha)
        if pending.excluded:
            reset_if_nonfinite(self.inner_optimizer, self.round + 1)
        return self._advanced(pending, mean_norm=mean_norm, mean_clipped=mean_clipped)

    def _outer_step(self, fragment: Fragment) -> None:
        for f in self.fragments:  # SGD steps the parameters that have a gradient
            f.param.grad = f.reduce.body if f is fragment else None
        self.outer_optimizer.step()

    def _advanced(self, pending: PendingRound, *, mean_norm: float, mean_clipped: bool) -> RoundReport:
        self.round += 1
        self.run_state.advanced()
        return log_round(report_of(pending, round=self.round, mean_norm=mean_norm, mean_clipped=mean_clipped))

    @torch.no_grad()
    def flush(self) -> None:
        """Complete every reduce in flight and apply it (streaming: as if its ``overlap_steps`` had passed;
        eager: ``Eager.flush``). Call it at the end of training; without overlap, nothing is in flight."""
        with self.run_state.lock:
            if self.eager is not None:
                eager_flush(self)
            for pending in list(self._pending):
                self.finish_round(pending)

    def state_dict(self) -> dict[str, Any]:
        """All needed to continue bit-identically (``diloco_state``); reduces in flight settle, kept for their step."""
        with self.run_state.lock:
            return state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.run_state.lock:
            load_state(self, state)

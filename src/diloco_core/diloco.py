"""DiLoCo: H local inner steps, then one averaged outer step on a shared global copy."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .agreement import check_settings
from .codec import codec_for
from .config import DiLoCoConfig, outer_lr_for
from .feedback import ErrorFeedback
from .flat import FlatBuffer, local_of, norm_of
from .guard import ContributionGuard
from .model_state import ModelState
from .report import PendingRound, RoundReport, log_round
from .run_state import RunState
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
       ``wire_dtype`` and summed in fp32;
    3. outer step: ``torch.optim.SGD`` (Nesterov) on the global copy, the mean used as its gradient;
    4. the new global params are copied into the model, and inner training resumes from them.

    If phase 2 raises ``TransportError`` nothing has changed: the global copy and the outer optimizer
    are as before and the model keeps its local params. ``step()`` retries the round up to
    ``round_retries`` times (survivors of a lost peer regroup), then lets the error through; the caller
    may call ``sync()`` again later. If it raises ``StateReplaced`` (this worker was behind its group and
    the transport loaded the group's state into it), ``step()`` returns None and training goes on.
    The inner optimizer's state is kept across rounds and never communicated.

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
    ) -> None:
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
        self.codec = codec_for(config.wire_dtype, config.codec_block)
        """How pseudo-gradients travel (``config.wire_dtype`` names it)."""
        self.reduce_key = "diloco/round"
        """The key of every round's reduce (a transport keeps its buffers per key)."""

        self._global = FlatBuffer(self.local, config.global_device)
        numel = self._global.flat.numel()
        self.guard = ContributionGuard(
            self.codec, norm_clip=config.norm_clip, numel=numel, compare=transport.fixed_ranks
        )
        """Leaves out non-finite contributions; with ``norm_clip``, clips outliers (``diloco_core.guard``)."""
        # After the pseudo-gradient, each in a codec block of its own (zeros pad up to it): the valid flag and
        # this worker's pseudo-gradient RMS, averaged in the same reduce (on the scale of the values, so they
        # survive the wire).
        self._pseudo_grad = FlatBuffer(self.local, config.global_device, extra=self.guard.tail_size)
        fed, on = self._global.flat.numel(), config.error_feedback
        self._feedback = ErrorFeedback(self.codec, self._pseudo_grad.flat, fed=fed, on=on)
        self._global_param = torch.nn.Parameter(self._global.flat, requires_grad=False)
        self._global_param.grad = self._pseudo_grad.body
        momentum = config.outer_momentum
        self.outer_lr = config.outer_lr if config.outer_lr is not None else outer_lr_for(transport.world_size, momentum)
        """The outer SGD's learning rate: ``config.outer_lr``, or the rule's for the transport's world size."""
        if config.outer_lr is None and not transport.fixed_ranks:
            logger.warning(
                "outer_lr is unset and the transport's peers come and go: using %.3g, the rule's value "
                "for %d worker(s); set outer_lr for the number you expect",
                self.outer_lr,
                transport.world_size,
            )
        self.outer_optimizer = torch.optim.SGD(
            [self._global_param],
            lr=self.outer_lr,
            momentum=momentum,
            nesterov=config.nesterov and momentum > 0,
            fused=True,  # one pass over the flat buffer instead of three (and no temporary the size of the model)
        )
        with torch.no_grad():
            check_settings(transport, self._settings(), timeout=config.reduce_timeout, device=self._global.flat.device)
            self.model_state.check_same(transport, config.reduce_timeout)
            self._global.copy_from(self.local)
            self.model_state.before_broadcast()
            transport.broadcast([self._global.flat, *self.model_state.shared], src=0, timeout=config.reduce_timeout)
            self._global.copy_to(self.local)
            self.model_state.after_broadcast()
        self.run_state = RunState(self)
        """The outer state a transport whose peers come and go serves to joiners (``Transport.attach``)."""
        self.joined = transport.attach(self.run_state, timeout=config.reduce_timeout)
        """True if this worker joined a run already going: global params, outer momentum and round came
        from its peers (only transports whose peers come and go do that)."""

    def _settings(self) -> dict[str, Any]:
        """What every worker must agree on (``agreement.check_settings``): the round's schedule, the outer
        step, how pseudo-gradients travel and the guard."""
        c = self.config
        block = self.codec.block if self.codec.elementwise_dtype is None else None  # cast wires have none
        return {
            "inner_steps": c.inner_steps,
            "outer_lr": self.outer_lr,
            "outer_momentum": c.outer_momentum,
            "nesterov": c.nesterov,
            "wire_dtype": self.codec.name,
            "codec_block": block,
            "error_feedback": self._feedback.on,
            "norm_clip": c.norm_clip,
        }

    @property
    def reduce_numel(self) -> int:
        """Values in one round's all-reduce: the pseudo-gradient, zeros up to a codec block, one diagnostic value."""
        return self._pseudo_grad.flat.numel()

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The fp32 global copy, one view per trainable parameter's ``local`` tensor (read only, please)."""
        return self._global.views

    def step(self) -> RoundReport | None:
        """Step the inner optimizer; on every ``inner_steps``-th call also run an outer round."""
        self.inner_optimizer.step()
        self.inner_step += 1
        if self.inner_step % self.config.inner_steps:
            return None
        for attempt in range(self.config.round_retries + 1):
            try:
                return self.sync()
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

    @torch.no_grad()
    def sync(self) -> RoundReport:
        """Run one outer round now (phases 1-4 of the class docstring): ``begin_round`` + ``finish_round``."""
        return self.finish_round(self.begin_round())

    @torch.no_grad()
    def begin_round(self) -> PendingRound:
        """Phases 1-2 of a round: compute this worker's pseudo-gradient and start its reduce. The model may
        train on meanwhile (the reduce reads a copy), though ``finish_round`` then sets it to the new global
        params; nothing else changes until ``finish_round``. A pseudo-gradient the guard refuses (NaN,
        infinite, out of the wire's range) is sent as zeros, flagged not valid (``diloco_core.guard``)."""
        start = time.perf_counter()
        self.model_state.check_trainable()
        pg, flat = self._pseudo_grad.body, self._pseudo_grad.flat
        self._pseudo_grad.copy_from(self.local)
        torch.sub(self._global.flat, pg, out=pg)
        local_norm = norm_of(pg)
        excluded, clipped, sent_norm = self.guard.admit(pg, local_norm)
        if not excluded:
            try:
                self._feedback.feed(flat)  # the norm is the pseudo-gradient's own, without the residual
            except ValueError:  # with the residual, past what the wire carries (fp16)
                excluded = True
        self.guard.mark(flat, excluded=excluded, norm=sent_norm, global_flat=self._global.flat)
        handle = self.transport.all_reduce([flat], codec=self.codec, key=self.reduce_key)
        buffers = self.model_state.begin(self.transport)
        return PendingRound(
            round=self.round + 1,
            handle=handle,
            pseudo_grad_norm=local_norm,
            started=start,
            buffers=buffers,
            excluded=excluded,
            clipped=clipped,
        )

    @torch.no_grad()
    def finish_round(self, pending: PendingRound) -> RoundReport:
        """Phases 2-4: wait for the mean, take the outer step, copy the new global params into the model.
        If the reduce raises ``TransportError`` nothing has changed (call ``begin_round`` again)."""
        if pending.round != self.round + 1:
            raise ValueError(f"pending round {pending.round} cannot finish: this worker is at round {self.round}")
        result = self.model_state.wait(pending.handle, pending.buffers, timeout=self.config.reduce_timeout)
        valid, contributors_norm = self.guard.settle(self._pseudo_grad.flat, result.num_contributors)
        if not pending.excluded:  # an excluded worker still owes the residual it had
            self._feedback.commit()
        pg = self._pseudo_grad.body
        mean_norm, mean_clipped = norm_of(pg), False
        if valid:
            mean_clipped, mean_norm = self.guard.clip_mean(pg, mean_norm=mean_norm, contributors_norm=contributors_norm)
            self.outer_optimizer.step()
        self._global.copy_to(self.local)
        if pending.excluded:
            self._reset_nonfinite_inner_state()
        self.round += 1
        self.run_state.advanced()
        report = RoundReport(
            round=self.round,
            num_contributors=result.num_contributors,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            comm_seconds=result.seconds,
            round_seconds=time.perf_counter() - pending.started,
            pseudo_grad_norm=pending.pseudo_grad_norm,
            mean_pseudo_grad_norm=mean_norm,
            agreement=mean_norm / contributors_norm if contributors_norm > 0 else 1.0,
            valid_contributors=valid,
            excluded=pending.excluded,
            clipped=pending.clipped,
            mean_clipped=mean_clipped,
        )
        log_round(report)
        return report

    def _reset_nonfinite_inner_state(self) -> None:
        """A worker whose training diverged restarts its inner optimizer if its moments hold NaN or inf."""
        tensors = [v for s in self.inner_optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            logger.warning("round %d: the inner optimizer's state is not finite: it starts afresh", self.round + 1)
            self.inner_optimizer.state.clear()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: model (trainable parameters, their names, and by
        name its frozen parameters and persistent buffers), global copy, both optimizers, counters, the
        error-feedback residual (None without), the contribution guard's references and what the transport keeps
        about the run's state."""
        return {
            "model": [p.detach() for p in self.local],
            "param_names": list(self.model_state.names),
            "model_state": self.model_state.state_dict(),
            "global": self._global.flat,
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "inner_step": self.inner_step,
            "round": self.round,
            "residual": self._feedback.residual,
            "guard": self.guard.state_dict(),
            "transport": self.transport.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"model", "global", "outer_optimizer", "inner_optimizer", "inner_step", "round"} - set(state)
        if missing:
            raise ValueError(f"DiLoCo state is missing {sorted(missing)}")
        model, flat = state["model"], state["global"]
        shapes = [tuple(t.shape) for t in model]
        if shapes != self._global.shapes or flat.shape != self._global.flat.shape:
            raise ValueError(
                f"DiLoCo state holds {len(shapes)} tensors ({flat.numel()} values); this model has "
                f"{len(self._global.shapes)} ({self._global.flat.numel()} values)"
            )
        self.model_state.check_loadable(state)  # absent names and model_state (older checkpoints) pass
        torch._foreach_copy_(self.local, list(model))
        self._global.flat.copy_(flat)
        self.model_state.load(state)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.inner_step = int(state["inner_step"])
        self.round = int(state["round"])
        self._feedback.load(state.get("residual"))  # absent (older checkpoints) or None: zero
        self.guard.load_state_dict(state.get("guard"))  # absent (older checkpoints): no reference yet
        if "transport" in state:  # absent from checkpoints written before it existed
            self.transport.load_state_dict(state["transport"])

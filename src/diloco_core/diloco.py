"""DiLoCo: H local inner steps, then one averaged outer step on a shared global copy."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from .codec import codec_for
from .config import DiLoCoConfig, outer_lr_for
from .feedback import ErrorFeedback
from .flat import FlatBuffer, local_of, norm_of
from .model_state import ModelState
from .run_state import RunState
from .transport import ReduceHandle, StateReplaced, Transport, TransportError

__all__ = ["DiLoCo", "PendingRound", "RoundReport"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingRound:
    """A round whose reduce is in flight (``DiLoCo.begin_round``); ``DiLoCo.finish_round`` completes it."""

    round: int
    """The round it completes (1 for the first)."""
    handle: ReduceHandle
    pseudo_grad_norm: float
    started: float
    """``time.perf_counter()`` when the round began."""
    buffers: ReduceHandle | None = None
    """The reduce of the model's floating-point buffers (``ModelState``), if it has any."""


@dataclass(frozen=True)
class RoundReport:
    round: int
    """Index of the outer round that just finished (1 for the first)."""
    num_contributors: int
    bytes_sent: int
    bytes_received: int
    comm_seconds: float
    """Seconds from starting the all-reduce until its mean was in place."""
    round_seconds: float
    """Seconds for the whole round: pseudo-gradient, all-reduce, outer step, copy back."""
    pseudo_grad_norm: float = 0.0
    """L2 norm of this worker's pseudo-gradient (global - local) in this round."""
    mean_pseudo_grad_norm: float = 0.0
    """L2 norm of the mean pseudo-gradient, the "gradient" the outer optimizer stepped with."""
    agreement: float = 1.0
    """``mean_pseudo_grad_norm`` over the contributors' mean pseudo-gradient norm: 1 when every worker
    moved the same way, about 1/sqrt(M) when M workers' moves are unrelated, 0 when they cancel out
    (1 also when every worker's pseudo-gradient is zero). The contributors' norms ride in the round's
    own all-reduce (one extra value), so reading it costs no extra round trip."""


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
        # After the pseudo-gradient, in a codec block of its own (zeros pad up to it): this worker's pseudo-
        # gradient RMS, averaged in the same reduce (on the scale of the values, so it survives the wire).
        pad = -self._global.flat.numel() % self.codec.block
        self._pseudo_grad = FlatBuffer(self.local, config.global_device, extra=pad + 1)
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
        params; nothing else changes until ``finish_round``."""
        start = time.perf_counter()
        self.model_state.check_trainable()
        pg, rms = self._pseudo_grad.body, self._pseudo_grad.tail[-1:]
        self._pseudo_grad.copy_from(self.local)
        torch.sub(self._global.flat, pg, out=pg)
        local_norm = norm_of(pg)
        if not math.isfinite(local_norm):  # on any wire the mean would be NaN or inf on every worker
            msg = (
                "pseudo-gradient holds NaN or infinite values (its local training diverged); not sent, nothing changed"
            )
            raise ValueError(f"round {self.round + 1}: this worker's {msg}")
        rms.fill_(local_norm / math.sqrt(pg.numel()))
        self._feedback.feed(self._pseudo_grad.flat)  # the norm is the pseudo-gradient's own, without it
        handle = self.transport.all_reduce([self._pseudo_grad.flat], codec=self.codec, key=self.reduce_key)
        buffers = self.model_state.begin(self.transport)
        return PendingRound(
            round=self.round + 1, handle=handle, pseudo_grad_norm=local_norm, started=start, buffers=buffers
        )

    @torch.no_grad()
    def finish_round(self, pending: PendingRound) -> RoundReport:
        """Phases 2-4: wait for the mean, take the outer step, copy the new global params into the model.
        If the reduce raises ``TransportError`` nothing has changed (call ``begin_round`` again)."""
        if pending.round != self.round + 1:
            raise ValueError(f"pending round {pending.round} cannot finish: this worker is at round {self.round}")
        result = self.model_state.wait(pending.handle, pending.buffers, timeout=self.config.reduce_timeout)
        self._feedback.commit()
        pg, rms = self._pseudo_grad.body, self._pseudo_grad.tail[-1:]
        mean_norm = norm_of(pg)
        contributors_norm = rms.item() * math.sqrt(pg.numel())  # contributors' mean pseudo-gradient norm
        self.outer_optimizer.step()
        self._global.copy_to(self.local)
        self.round += 1
        self.run_state.advanced()
        local_norm = pending.pseudo_grad_norm
        report = RoundReport(
            round=self.round,
            num_contributors=result.num_contributors,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            comm_seconds=result.seconds,
            round_seconds=time.perf_counter() - pending.started,
            pseudo_grad_norm=local_norm,
            mean_pseudo_grad_norm=mean_norm,
            agreement=mean_norm / contributors_norm if contributors_norm > 0 else 1.0,
        )
        logger.info(
            "round %d: %d contributors, %.1f MB sent, %.1f MB received, %.3fs comm, %.3fs round, "
            "|delta| %.4g, |mean delta| %.4g, agreement %.3f",
            report.round,
            report.num_contributors,
            report.bytes_sent / 1e6,
            report.bytes_received / 1e6,
            report.comm_seconds,
            report.round_seconds,
            report.pseudo_grad_norm,
            report.mean_pseudo_grad_norm,
            report.agreement,
        )
        return report

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: model (trainable parameters, their names, and by
        name its frozen parameters and persistent buffers), global copy, both optimizers, counters, the
        error-feedback residual (None without) and what the transport keeps about the run's state."""
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
        if "transport" in state:  # absent from checkpoints written before it existed
            self.transport.load_state_dict(state["transport"])

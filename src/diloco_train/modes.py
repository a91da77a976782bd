"""What keeps the workers in step, per mode: nothing (single), a gradient all-reduce at every step (ddp),
DiLoCo's outer rounds (diloco), and diloco's optional DDP warm start that hands over to DiLoCo from its weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from diloco_core import DiLoCo, RoundReport, Transport
from diloco_core.codecs.names import codec_of
from diloco_core.config import outer_lr_for
from diloco_core.feedback import ErrorFeedback
from diloco_core.flat import FlatBuffer

from .model import Llama
from .run_config import RunConfig

__all__ = ["Comm", "Sync", "ddp_wire", "warm_start_steps"]


def warm_start_steps(config: RunConfig, *, fixed_ranks: bool) -> int:
    """``train.ddp_warm_start``, or where unset a twelfth of the steps if the transport's ranks are fixed
    (and the model is whole: FSDP islands have no DDP phase)."""
    t = config.train
    if t.ddp_warm_start is not None:
        return t.ddp_warm_start
    return t.steps // 12 if fixed_ranks and t.fsdp_shards == 1 else 0


def ddp_wire(config: RunConfig) -> str:
    """The codec of DDP's gradients: ``train.ddp_wire_dtype``, or where unset fp32 in ddp mode (the baseline) and
    the rounds' codec in diloco's warm start, int4 where the rounds go below 4 bits a value (sign gradients lost
    3.4%: AdamW's second moment takes in the codec's noise; int2 and topk are as coarse)."""
    t, codec = config.train, config.diloco.codec
    if t.ddp_wire_dtype is not None:
        return t.ddp_wire_dtype
    if t.mode != "diloco":
        return "fp32"
    return "int4" if codec in ("sign", "int2", "topk") else codec


@dataclass(frozen=True)
class Comm:
    """What one step's communication cost this worker."""

    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


class Sync:
    """One worker's side of its mode. Built at the worker's first step (``start_step``), where DDP (and a
    warm start) broadcasts rank 0's weights and DiLoCo starts (a joiner takes the run's outer state there)."""

    def __init__(
        self,
        *,
        config: RunConfig,
        model: Llama,
        optimizer: torch.optim.Optimizer,
        transport: Transport | None,
        device: torch.device,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.transport = transport
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.timeout = config.diloco.reduce_timeout
        # DDP's gradients travel on their own wire, with their own error feedback
        self.wire = codec_of(config.diloco, ddp_wire(config))
        self.feedback: ErrorFeedback | None = None
        mode = config.train.mode
        fixed = transport is not None and transport.capabilities.fixed_ranks
        # DDP steps first
        self.warm = warm_start_steps(config, fixed_ranks=fixed) if mode == "diloco" else 0
        self.diloco: DiLoCo | None = None
        self._warm_diloco = False  # self.diloco is the warm start's (warm_start_sync = "updates")
        self.grads: FlatBuffer | None = None
        if mode == "diloco" and not self.warm:
            self._start_diloco()
        elif mode == "diloco" and config.train.warm_start_sync == "updates":
            # one DiLoCo per transport, and no joiner in it
            if transport is None or not transport.capabilities.fixed_ranks:
                raise ValueError(
                    "train.warm_start_sync='updates' is invalid on a transport whose peers come and go: "
                    "expected fixed ranks (in-process, torch), or train.ddp_warm_start=0"
                )
            self._start_diloco(warm=True)
        elif mode != "single":
            assert transport is not None
            with torch.no_grad():
                transport.broadcast(self.params, src=0, timeout=self.timeout)
            self.grads = FlatBuffer(self.params, device)
            n = self.grads.flat.numel()
            # its kernels: not in a step
            self.wire.prepare(self.grads.flat, payloads=(2, transport.world_size))
            self.feedback = ErrorFeedback(
                self.wire, self.grads.flat, fed=n, on=config.train.ddp_error_feedback
            )
        d = self.diloco
        self._start_step = self.warm + d.inner_step if d is not None and d.joined else 0

    @property
    def start_step(self) -> int:
        """The run's step this worker starts at, before any resume: 0, or where it joined a run already going
        (its transport loaded the peers' DiLoCo state as DiLoCo was built) that state's step: the warm start's
        steps and DiLoCo's inner steps (with rounds by time ``inner_steps`` per round done, as ``advanced``
        counts). ``train.steps`` is the run's length: a joiner trains from here to there."""
        return self._start_step

    @property
    def round(self) -> int:
        """DiLoCo's outer round (0 before it starts, and in the other modes)."""
        return self.diloco.round if self.diloco is not None else 0

    @property
    def elastic(self) -> bool:
        """DiLoCo runs (past any warm start) with rounds that end by time (``diloco.round_seconds``)."""
        return (
            self.diloco is not None
            and not self._warm_diloco
            and self.diloco.config.round_seconds is not None
        )

    def advanced(self, step: int) -> int:
        """The trainer's step once this worker took one more inner step from ``step``: ``step + 1``; with rounds
        by time, the run's progress instead, the same on every worker: the warm start's steps, then
        ``inner_steps`` per round done (it moves only when a round ends)."""
        if not self.elastic:
            return step + 1
        assert self.diloco is not None
        return self.warm + self.diloco.round * self.diloco.config.inner_steps

    def position(self, step: int) -> int:
        """Where the learning-rate schedule is at ``step`` (``advanced``'s): ``step``; with rounds by time, the
        steps into this round counted up to a round's ``inner_steps`` (a fast worker holds the round's last
        rate, a slow one jumps to the next round's)."""
        if not self.elastic:
            return step
        assert self.diloco is not None
        return step + min(self.diloco.rounds.steps_in_round, self.diloco.config.inner_steps - 1)

    def resumed_at(self, step: int) -> None:
        """A checkpoint past the warm start holds DiLoCo's state: DiLoCo takes over before it is loaded."""
        if self.warm and step > self.warm:
            self._start_diloco()

    def before(self, step: int) -> None:
        """Called before each step: at the end of the warm start, DiLoCo starts from these weights."""
        if self.warm and step == self.warm and (self.diloco is None or self._warm_diloco):
            self._start_diloco()

    def step(self, grad_clip: float) -> tuple[Comm, RoundReport | None]:
        """After the backward pass: average the gradients (ddp), clip them, step (DiLoCo's inner step and,
        at a round's end, its outer round; else the optimizer), zero the gradients."""
        comm = Comm()
        if self.grads is not None:
            assert self.transport is not None
            grads = self.grads
            with torch.no_grad():
                grads.copy_from([p.grad for p in self.params])
                assert self.feedback is not None
                self.feedback.feed(grads.flat)
                result = self.transport.all_reduce(
                    [grads.flat], codec=self.wire, key="ddp/grads"
                ).wait(self.timeout)
                self.feedback.commit()
                grads.copy_to([p.grad for p in self.params])
            comm = Comm(result.seconds, result.bytes_sent, result.bytes_received)
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, grad_clip)
        report: RoundReport | None = None
        if self.diloco is not None:
            report = self.diloco.step()
            sent = (report.bytes_sent, report.bytes_received) if report is not None else (0, 0)
            # what the step waited for (overlap: not the reduce)
            comm = Comm(self.diloco.outer_seconds, *sent)
            # a warm start's step, counted in bytes as DDP's, not as an outer round
            if self._warm_diloco:
                report = None
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return comm, report

    def flush(self) -> None:
        """At the end of training: apply the outer rounds still in flight (DiLoCo's overlap modes)."""
        if self.diloco is not None:
            self.diloco.flush()

    def state_dict(self) -> dict[str, Any]:
        """The mode's part of a checkpoint: DiLoCo's state, else the weights and the optimizer's."""
        if self.diloco is not None:
            return self.diloco.state_dict()
        state = {
            "model": [p.detach() for p in self.model.parameters()],
            "inner_optimizer": self.optimizer.state_dict(),
        }
        residual = self.feedback.residual if self.feedback is not None else None
        return state if residual is None else {**state, "ddp_residual": residual}

    def load_state_dict(self, core: dict[str, Any]) -> None:
        diloco = self.diloco
        if diloco is not None and diloco.joined:
            # The swarm's global params, outer momentum and round are newer than this checkpoint:
            # take only what is this peer's own, its inner optimizer (and its data position, elsewhere).
            self.optimizer.load_state_dict(core["inner_optimizer"])
        elif diloco is not None:
            diloco.load_state_dict(core)
        else:
            _check_model(core["model"], self.model)
            with torch.no_grad():
                torch._foreach_copy_(
                    list(self.model.parameters()), [t.to(self.device) for t in core["model"]]
                )
            self.optimizer.load_state_dict(core["inner_optimizer"])
            if self.feedback is not None:
                self.feedback.load(core.get("ddp_residual"))

    def _start_diloco(self, *, warm: bool = False) -> None:
        """DiLoCo over this worker's model. An unset outer lr is the core's rule for the transport's world size;
        peers that come and go have none up front, so the rule takes the number of data shards there. ``warm``:
        the warm start that averages updates, DiLoCo with H = 1 and plain averaging on the warm start's wire."""
        assert self.transport is not None
        c, t = self.config.diloco, self.config.train
        if warm:
            c = c.every_step(codec=ddp_wire(self.config), error_feedback=t.ddp_error_feedback)
        elif c.outer_lr is None and not self.transport.capabilities.fixed_ranks:
            c = replace(c, outer_lr=outer_lr_for(max(t.num_shards, 1), c.outer_momentum))
        self.diloco = DiLoCo(
            model=self.model, inner_optimizer=self.optimizer, transport=self.transport, config=c
        )
        self._warm_diloco = warm
        self.grads = self.feedback = None  # the warm start's residual ends with it


def _check_model(saved: list[torch.Tensor], model: Llama) -> None:
    """A checkpoint of another model (a [model] key changed since it was written) is named, not torch's error."""
    named = list(model.named_parameters())
    advice = "resume with the [model] of the run's config.toml, or start a new run"
    if len(saved) != len(named):
        raise ValueError(
            f"the checkpoint's model has {len(saved)} parameter tensors, this run's has {len(named)} "
            f"(model.num_layers changed?): {advice}"
        )
    for (name, p), t in zip(named, saved):
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(
                f"the checkpoint's model has {name} of shape {tuple(t.shape)}, this run's has {tuple(p.shape)}: {advice}"
            )

"""The trainer's own section of the config, ``[train]``: mode, workers, schedule, evaluation, checkpoints,
logging; each field's valid values declared in its metadata (``diloco_core.rules``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco_core import CODECS
from diloco_core.rules import (
    boolean,
    check_field,
    check_fields,
    choice,
    integer,
    number,
    rule,
    string,
)

__all__ = ["INNER_OPTIMIZERS", "MAX_SEED", "MODES", "SINKS", "WARM_START_SYNCS", "TrainConfig"]

MODES = ("diloco", "ddp", "single")
WARM_START_SYNCS = ("gradients", "updates")
INNER_OPTIMIZERS = ("adamw", "muon")
SINKS = ("tensorboard", "wandb")  # sinks.py writes them
# torch.Generator's seeds are 64-bit: above, "Overflow when unpacking long long"
MAX_SEED = 2**64 - 1


def _is_speed(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1


def _is_device(v: object) -> bool:
    return isinstance(v, str) and (v in ("auto", "cpu", "cuda") or v.startswith("cuda:"))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    mode: str = field(default="diloco", metadata=choice(MODES))
    """diloco (outer round every diloco.inner_steps), ddp (gradients averaged every step) or single (one worker)."""
    workers: int = field(default=4, metadata=integer(low=1))
    """Workers as threads of this process (in-process transport). Other transports: one worker per process."""
    steps: int = field(default=600, metadata=integer(low=1))
    """The run's length in inner steps per worker, the same on every peer; the learning-rate schedule
    spans them. A peer that joins a run already going starts at the run's step (``Sync.start_step``)."""
    batch_size: int = field(default=32, metadata=integer(low=1))
    """Sequences per step per worker. DiLoCo needs enough of them per worker step: with 64-byte windows it
    ended 8.6% above DDP at 8, 6.4% at 16 (docs/results.md, which also has this default's figure)."""
    inner_optimizer: str = field(default="adamw", metadata=choice(INNER_OPTIMIZERS))
    """adamw, or muon: torch's Muon for the decoder blocks' matrices (attention and MLP) at ``muon_lr``, AdamW
    for the embeddings, the output head and the norms at ``lr`` (diloco_train.inner_optimizer)."""
    lr: float = field(default=1e-3, metadata=number(gt=0, noun="a finite number"))
    """Peak learning rate of the inner AdamW (the papers use 4e-4 for 150M+; the tiny model trains faster at 1e-3)."""
    muon_lr: float = field(default=0.02, metadata=number(gt=0, noun="a finite number"))
    """inner_optimizer = "muon": peak learning rate of Muon's matrices, on ``lr``'s warmup and cosine (Keller
    Jordan's 0.02, torch's default scaling). At ``lr`` with torch's "match_rms_adamw" scaling (meant to reuse
    AdamW's lr) the tiny model ended 8% above AdamW, at 0.02 10% below it (docs/trainer.md, "Inner optimizer")."""
    min_lr_ratio: float = field(default=0.1, metadata=number(ge=0, le=1))
    """The cosine decays the learning rate to lr * min_lr_ratio at the last step."""
    warmup_steps: int = field(default=50, metadata=integer(low=0))
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = field(default=0.1, metadata=number(ge=0))
    """Weight decay of the matrices: each step multiplies them by 1 - lr * weight_decay (AdamW's decoupled decay;
    Muon's matrices decay at that same rate, whatever ``muon_lr``)."""
    beta1: float = field(default=0.9, metadata=number(ge=0, lt=1))
    """AdamW beta1."""
    beta2: float = field(default=0.95, metadata=number(ge=0, lt=1))
    """AdamW beta2."""
    grad_clip: float = field(default=1.0, metadata=number(ge=0))
    """Clip the gradient norm to this (0: no clipping)."""
    ddp_warm_start: int | None = field(
        default=None, metadata=integer(low=0, unset=True, valid="an integer >= 0")
    )
    """diloco mode: steps of DDP (gradients averaged every step) before the first DiLoCo round starts. None: a
    twelfth of ``steps`` (50 of the default run's 600) where the transport's ranks are fixed (in-process, torch),
    0 where peers come and go (hivemind: a joiner could not take part in a DDP phase)."""
    ddp_wire_dtype: str | None = field(
        default=None, metadata=rule(lambda v: v is None or v in CODECS, f"one of {sorted(CODECS)}")
    )
    """The wire of DDP's gradients (ddp mode, diloco's warm start): a codec name as ``diloco.codec``. None: fp32 in
    ddp mode; in diloco's warm start the rounds' ``diloco.codec`` (int4 by default; int4 where they are sign or topk):
    at 100 Mbit/s an fp32 warm start was 36 s of the old default's 78 s to DDP's loss; an int4 one reached that
    loss at the same step on 2 of 3 seeds, 40 steps later on the third (docs/results.md, "Time to a target loss")."""
    warm_start_sync: str = field(default="gradients", metadata=choice(WARM_START_SYNCS))
    """What diloco's warm start averages every step: ``gradients`` (DDP: one AdamW step on the mean gradient) or
    ``updates`` (each worker's own AdamW step, then the mean of the workers' weights: DiLoCo with H = 1 and
    an outer SGD of lr 1 without momentum, on ``ddp_wire_dtype`` with ``ddp_error_feedback``). A 1-bit wire
    (``sign``) loses 3.4% on gradients, where AdamW's second moment takes in its noise (docs/results.md)."""
    ddp_error_feedback: bool = field(default=True, metadata=boolean())
    """With a lossy ``ddp_wire_dtype``: each worker adds what the codec dropped of its last gradient to its next
    one (in ddp mode's checkpoints; a warm start's residual ends with it, when DiLoCo takes over)."""
    seed: int = field(default=0, metadata=integer(low=0, high=MAX_SEED))
    """Seed of the weights (rank 0's, broadcast to all) and of every worker's data order (64-bit)."""
    eval_every: int = field(default=0, metadata=integer(low=0))
    """Evaluate on validation every this many steps (0: every diloco.inner_steps), at the first round boundary at
    or after each multiple, on the run's global weights (diloco_train.evals)."""
    eval_batches: int = field(default=8, metadata=integer(low=1))
    """Validation batches per evaluation (the same windows every time)."""
    checkpoint_every: int = field(default=10, metadata=integer(low=0))
    """Checkpoint every this many rounds (of diloco.inner_steps steps, in every mode) and at the end; 0: only at the end."""
    keep_checkpoints: int = field(default=2, metadata=integer(low=1))
    """Checkpoints kept per worker; older ones are deleted."""
    max_nonfinite_losses: int = field(default=3, metadata=integer(low=1))
    """Stop with an error once a worker's loss is NaN or infinite at this many steps in a row (its weights then
    are too: nothing trains on). A state that is not finite is never checkpointed."""
    stop_after: int = field(default=0, metadata=integer(low=0))
    """Stop (after a checkpoint) once this many steps are done, schedule unchanged; resume later. 0: run all steps."""
    shard: int = field(
        default=-1, metadata=integer(low=-1, valid="an integer >= 0 (or -1: the rank)")
    )
    """This process's data shard when the transport has no fixed ranks (hivemind: give each peer its own). -1: its rank."""
    num_shards: int = field(default=0, metadata=integer(low=0))
    """Number of data shards for ``shard``. 0: the transport's world size."""
    fsdp_shards: int = field(default=1, metadata=integer(low=1))
    """diloco mode under torchrun: ranks per island, which shard one model with FSDP2 (``fully_shard``) and
    train it as one DiLoCo worker; DiLoCo averages across the world size / fsdp_shards islands, each rank
    its own shards (docs/lan.md). 1: every process holds the whole model."""
    device: str = field(default="auto", metadata=rule(_is_device, "auto, cpu, cuda or cuda:N"))
    """cpu, cuda, cuda:N or auto (cuda if available). In-process workers on cuda spread over the visible GPUs."""
    bf16: bool = field(default=True, metadata=boolean())
    """bf16 autocast for the forward pass on cuda (ignored on cpu)."""
    speeds: tuple[float, ...] = field(
        default=(),
        metadata=rule(
            lambda v: isinstance(v, (list, tuple)) and all(_is_speed(s) for s in v),
            "a list of numbers in (0, 1]",
        ),
    )
    """Simulated worker speeds (docs/elastic.md): worker r (its data shard where peers come and go) runs at
    ``speeds[r % len(speeds)]``, waiting (1/speed - 1) times each step's compute. Empty: every worker at 1."""
    threads: int = field(default=0, metadata=integer(low=0))
    """torch intra-op threads for this process (0: CPU cores // in-process workers, at least 1)."""
    runs_dir: str = field(default="runs", metadata=string(empty=False, valid="a non-empty path"))
    """Runs are written to <runs_dir>/<name>/."""
    log_to: tuple[str, ...] = field(
        default=(),
        metadata=rule(
            lambda v: (
                isinstance(v, (list, tuple))
                and all(s in SINKS for s in v)
                and len(set(v)) == len(v)
            ),
            f"a list of distinct names from {SINKS}",
        ),
    )
    """Also log the metrics records to: "tensorboard" (event files in <run>/tensorboard/), "wandb" (each an
    extra, docs/trainer.md). Empty: metrics.jsonl only."""

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "speeds", tuple(float(s) for s in self.speeds))
        object.__setattr__(self, "log_to", tuple(self.log_to))
        ok = self.fsdp_shards == 1 or (self.mode == "diloco" and not self.ddp_warm_start)
        check_field(
            "fsdp_shards",
            self.fsdp_shards,
            ok,
            "1, or in diloco mode without ddp_warm_start any N >= 1",
        )
        # torch's Muon orthogonalizes whole matrices: on FSDP2's row shards (DTensor) every step would gather them
        ok = self.fsdp_shards == 1 or self.inner_optimizer == "adamw"
        valid = f"adamw with fsdp_shards={self.fsdp_shards} (muon: whole matrices, fsdp_shards=1)"
        check_field("inner_optimizer", self.inner_optimizer, ok, valid)
        ok = self.inner_optimizer != "muon" or hasattr(torch.optim, "Muon")  # torch >= 2.9
        check_field(
            "inner_optimizer",
            self.inner_optimizer,
            ok,
            f"adamw: torch {torch.__version__} has no Muon",
        )
        # None: the default, a twelfth of the steps where ranks are fixed (modes.warm_start_steps)
        w = self.ddp_warm_start
        ok = not w or (self.mode == "diloco" and w < self.steps)
        check_field(
            "ddp_warm_start", w, ok, f"0, or in diloco mode a step count below steps={self.steps}"
        )
        ok = self.shard < max(self.num_shards, 1) if self.num_shards else self.shard <= 0
        check_field(
            "shard",
            self.shard,
            ok,
            f"below num_shards={self.num_shards} (set num_shards with shard)",
        )

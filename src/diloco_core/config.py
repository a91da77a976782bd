"""DiLoCo's configuration: one frozen, keyword-only dataclass, validated on construction."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field, replace

from .codecs.block import check_block
from .codecs.names import CODECS
from .codecs.sparse import DENSITY
from .rules import boolean, check_field, check_fields, choice, integer, is_int, number, rule, string

__all__ = ["MERGE_RULES", "OVERLAP_MODES", "DiLoCoConfig", "codec_from_alias", "outer_lr_for", "outer_lr_of"]

logger = logging.getLogger(__name__)

OVERLAP_MODES = ("none", "streaming", "eager")
"""How a round's reduce meets training (``DiLoCoConfig.overlap``, docs/overlap.md)."""
MERGE_RULES = ("robust", "mean")
"""``DiLoCoConfig.merge``'s values: ``diloco_core.merge.MergeRule``'s."""


def codec_from_alias(wire_dtype: object, *, stacklevel: int = 2) -> object:
    """``codec``'s value for the deprecated key ``wire_dtype`` (int4 and sign are no dtypes): checked under the name
    the user wrote, and a ``DeprecationWarning`` at the caller's caller (``stacklevel``)."""
    check_field(
        "wire_dtype",
        wire_dtype,
        isinstance(wire_dtype, str) and wire_dtype in CODECS,
        f"one of {sorted(CODECS)} (deprecated: use codec)",
    )
    msg = f"wire_dtype={wire_dtype!r} is deprecated: use codec={wire_dtype!r} (the same names)"
    warnings.warn(msg, DeprecationWarning, stacklevel=stacklevel + 1)
    return wire_dtype


def outer_lr_for(num_workers: int, momentum: float) -> float:
    """The outer learning rate for ``num_workers`` workers at outer ``momentum`` (Nesterov), when unset.

    Nesterov momentum mu multiplies a steady outer step by 1 / (1 - mu); the rule sets that effective
    step ``lr / (1 - mu)`` to ``1 + 0.2 * log2(M)``: 1 for one worker (plain training's step), 1.4 for
    4, 1.6 for 8. The mean of M workers' pseudo-gradients is shorter than each (they partly disagree),
    so the best step grows with M, but slowly: measured on the tiny model at H = 10, effective steps
    of 2 and more diverged or lost to 1.4 at M = 4, and 0.5 at momentum 0.5 was best for M = 1
    (docs/results.md). The scaling-law paper (arXiv 2503.09799) finds the same growth with M.
    """
    if not is_int(num_workers) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} is invalid: expected an integer >= 1")
    return (1 + 0.2 * math.log2(num_workers)) * (1 - momentum)


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    inner_steps: int = field(default=500, metadata=integer(low=1))
    """H: inner optimizer steps between two outer rounds (the paper's 500)."""
    round_seconds: float | None = field(
        default=None, metadata=number(gt=0, noun="a finite number of seconds", unset=True)
    )
    """Elastic rounds (docs/elastic.md): a round ends at the first inner step at which this many seconds have
    passed since the last one ended on this worker, whatever its number of steps; each worker's pseudo-gradient
    then weighs its steps / ``inner_steps`` (the guard's work weight, at most ``MAX_WORK``), so a worker twice
    as fast counts twice. Unset: every ``inner_steps``-th step (lock-step). Needs ``overlap = "none"``."""
    outer_lr: float | None = field(default=None, metadata=number(gt=0, noun="a finite number", unset=True))
    """Learning rate of the outer SGD (1.0 with momentum 0 is plain averaging). Unset: chosen by the number
    of workers M at construction, ``outer_lr_for(M, outer_momentum)`` (docs/results.md has the sweep
    behind the rule). A transport whose peers come and go knows no M up front: set it there. Eager updates
    take the rule's value for M = 1 (the others' shares arrive a round late: 0.5 beat 0.7 and 0.35 at M = 4)."""
    outer_momentum: float = field(default=0.5, metadata=number(ge=0, lt=1))
    """Momentum of the outer SGD. The paper's 0.9 (with lr 0.7) needs hundreds of rounds to pay off; 0.5
    was best in our sweep at H = 10-50 and stays stable with the unset-lr rule (docs/results.md)."""
    nesterov: bool = field(default=True, metadata=boolean())
    """Nesterov momentum for the outer SGD. With momentum 0 both forms are the same plain SGD step."""
    codec: str = field(default="fp32", metadata=choice(sorted(CODECS)))
    """The codec the pseudo-gradients travel in (``diloco_core.codecs.CODECS``): fp32, fp16, bf16 (casts), int8,
    int4, int2, sign (``codec_block`` values per fp32 scale), topk (the largest of them: docs/codecs.md). Sums are in fp32."""
    wire_dtype: str | None = field(default=None, repr=False, compare=False)
    """Deprecated alias of ``codec`` (int4 and sign are not dtypes): given, it sets ``codec`` and warns."""
    codec_block: int = 256
    """Values per scale of the int8, int4, int2, sign and topk codecs: a power of two in [16, 65536] ([32, 65536] for sign)."""
    codec_density: float = field(default=DENSITY, metadata=number(gt=0, le=0.5))
    """topk: the share of a block's values sent, its largest |x|, round(density * codec_block) >= 1 of them."""
    codec_value_bits: int = field(default=2, metadata=rule(lambda v: v in (2, 4) and is_int(v), "2 or 4"))
    """topk: bits per value sent (2 or 4), besides its index in the block (log2(codec_block) bits)."""
    error_feedback: bool = field(default=True, metadata=boolean())
    """Add what a lossy codec dropped of this worker's pseudo-gradients to its next one (not for fp32).
    Saved in ``DiLoCo.state_dict()``; not served to joiners, who start from a zero residual."""
    reduce_timeout: float = field(default=600.0, metadata=number(gt=0, noun="a finite number of seconds"))
    """Seconds an outer all-reduce (or the initial broadcast) may take before TransportError."""
    round_retries: int = field(default=2, metadata=integer(low=0))
    """Times ``step()`` retries a round whose all-reduce failed (a peer left: the survivors regroup)
    before the TransportError reaches the caller. Nothing changes until a round succeeds."""
    norm_clip: float | None = field(default=None, metadata=number(gt=1, noun="a finite number", unset=True))
    """The norm guard (``diloco_core.guard``): clip each worker's pseudo-gradient, and the round's mean, to
    this many times their norms in the last round it did not clip. Unset: off. A number > 1 (e.g. 4)."""
    merge: str = field(default="robust", metadata=choice(MERGE_RULES))
    """How a round's contributions become its update (``diloco_core.merge``): ``robust`` (3 contributors or
    more) clips a contribution farther than ``outlier_ratio`` median spreads from the centre of the tightest
    majority to that radius, and leaves it out only if it is also flipped against the centre or over 100x the
    median norm (``diloco_core.judge``); where none is clipped or left out, the plain mean bit for bit.
    ``mean``: the plain mean (``MERGE_RULES``)."""
    rda: bool = field(default=False, metadata=boolean())
    """Radial-directional averaging (``diloco_core.directions``): each tensor's update is the workers' mean norm
    along their mean unit direction, not the plain mean, whose length shrinks towards 1/√M of theirs as M workers
    partly disagree: for many workers, or an outer lr that should not depend on M. Not with ``overlap = "eager"``."""
    outlier_ratio: float = field(default=3.0, metadata=number(gt=1, noun="a finite number"))
    """``merge = "robust"``: the radius, in median spreads from the centre, beyond which a contribution is
    clipped (``diloco_core.judge``)."""
    overlap: str = field(default="none", metadata=choice(OVERLAP_MODES))
    """``none`` (every worker waits for the round's mean), ``streaming`` (the model's fragments one after another,
    each reduce behind ``overlap_steps`` inner steps) or ``eager`` (the round's reduce behind the next
    ``inner_steps``, this worker's fresh pseudo-gradient applied at once): ``OVERLAP_MODES``."""
    fragments: int = field(
        default=1, metadata=integer(low=1, high=lambda c: c.inner_steps, valid="an integer in [1, inner_steps={high}]")
    )
    """Streaming: P, the fragments synchronized one after another, every ``inner_steps // P`` steps (strided
    blocks of the model: block i in fragment i % P; an integer in [1, inner_steps])."""
    overlap_steps: int = field(
        default=0,
        metadata=integer(low=0, high=lambda c: c.inner_steps - 1, valid="an integer in [0, inner_steps - 1 = {high}]"),
    )
    """Streaming: tau, inner steps a fragment's reduce runs behind before its outer step is applied (an integer
    in [0, inner_steps - 1]; 0 waits at once)."""
    merge_alpha: float = field(default=0.0, metadata=number(ge=0, le=1))
    """Streaming: a synced fragment becomes ``alpha * local + (1 - alpha) * global`` (0: the global params)."""
    eager_fresh_weight: float | None = field(default=None, metadata=number(gt=0, le=1, unset=True))
    """Eager: w in (0, 1], how much of the change in this worker's own pseudo-gradient since the last round it
    adds to the round-old mean: it steps with Δ̄(t-1) + w (Δ_m(t) - Δ_m(t-1)); 1 / M is the paper's rule.
    Unset: max(0.5, 1 / M), the paper's for M <= 2; at M = 4 it lost 2.3% to blocking, 1 / M 3.9% (docs/overlap.md)."""
    global_device: str = field(default="cpu", metadata=string(valid="a torch device string"))
    """Where the fp32 global copy and the outer optimizer state live (CPU saves accelerator memory)."""

    def __post_init__(self) -> None:
        if (old := self.wire_dtype) is not None:
            if self.codec not in ("fp32", old):  # fp32: codec's default, so codec was not given
                raise ValueError(f"codec={self.codec!r} and wire_dtype={old!r} disagree: set codec alone")
            object.__setattr__(self, "codec", codec_from_alias(old, stacklevel=4))
            object.__setattr__(self, "wire_dtype", None)
        check_fields(self)
        check_block(self.codec_block, "codec_block")
        b, d = self.codec_block, self.codec_density
        check_field("codec_block", b, self.codec != "sign" or b >= 32, "a power of two in [32, 65536] for codec='sign'")
        ok = self.codec != "topk" or d * b >= 0.5
        check_field("codec_density", d, ok, f"a number in [{0.5 / b:g}, 0.5] at codec_block={b}: one value per block")
        mode, w = self.overlap, self.eager_fresh_weight
        p, tau, alpha = self.fragments, self.overlap_steps, self.merge_alpha
        if mode != "eager" and w is not None:
            raise ValueError(
                f"eager_fresh_weight={w:g} is eager's setting: set overlap='eager' or leave it unset (overlap={mode!r})"
            )
        if mode != "streaming" and (p, tau, alpha) != (1, 0, 0):
            raise ValueError(
                f"fragments={p}, overlap_steps={tau}, merge_alpha={alpha:g} are streaming's settings: "
                f"set overlap='streaming' or leave them at 1, 0, 0 (overlap={mode!r})"
            )
        if self.rda and mode == "eager":
            raise ValueError("rda=True needs each round's own mean, but overlap='eager' steps with the last one's")
        if self.rda and self.codec == "topk":  # it keeps k values of a run of one norm: RDA reads the run past them
            raise ValueError("rda=True sends each norm as a run of one value, which codec='topk' keeps only k of")
        if self.round_seconds is not None and mode != "none":
            raise ValueError(
                f"round_seconds={self.round_seconds:g} ends rounds by time, but overlap={mode!r} schedules them by "
                "steps: set overlap='none' or leave round_seconds unset"
            )
        try:
            import torch

            torch.device(self.global_device)
        except RuntimeError as e:
            raise ValueError(f"global_device={self.global_device!r} is invalid: {e}") from None

    def every_step(self, *, codec: str, error_feedback: bool) -> DiLoCoConfig:
        """This config as plain averaging of every step's update (the trainer's DDP warm start that
        averages updates): H = 1, the outer SGD a plain step (lr 1, no momentum), lock-step rounds with no
        overlap, streaming, eager weight or RDA, on ``codec`` with ``error_feedback``; the rest (timeouts,
        retries, guards, the merge rule) as here. A new setting that changes the round says here what it
        is for plain averaging."""
        return replace(
            self,
            inner_steps=1,
            round_seconds=None,
            outer_lr=1.0,
            outer_momentum=0.0,
            overlap="none",
            fragments=1,
            overlap_steps=0,
            merge_alpha=0.0,
            eager_fresh_weight=None,
            rda=False,
            codec=codec,
            error_feedback=error_feedback,
        )


def outer_lr_of(config: DiLoCoConfig, *, world_size: int, fixed_ranks: bool) -> float:
    """``config.outer_lr``, or the rule's for the world size (eager: for 1, as M's share of each step lags);
    said where peers come and go, as the world size is then a guess."""
    if config.outer_lr is not None:
        return config.outer_lr
    lr = outer_lr_for(1 if config.overlap == "eager" else world_size, config.outer_momentum)
    if not fixed_ranks:
        logger.warning(
            "outer_lr is unset and the transport's peers come and go: using %.3g, the rule's value "
            "for %d worker(s); set outer_lr for the number you expect",
            lr,
            world_size,
        )
    return lr

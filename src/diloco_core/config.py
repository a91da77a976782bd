"""DiLoCo's configuration: one frozen, keyword-only dataclass, validated on construction."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .codecs.block import check_block
from .codecs.names import CODECS

__all__ = ["OVERLAP_MODES", "DiLoCoConfig", "check_field", "from_mapping", "is_finite_number", "outer_lr_for"]

OVERLAP_MODES = ("none", "streaming", "eager")
"""How a round's reduce meets training (docs/overlap.md): ``none`` blocks; ``streaming`` syncs the model's
fragments one after another, each reduce behind ``overlap_steps`` inner steps; ``eager`` runs the whole
round's reduce behind the next ``inner_steps`` and applies this worker's fresh pseudo-gradient at once."""


def check_field(name: str, value: object, ok: bool, valid: str) -> None:
    """Raise ``ValueError`` naming the field, the value and the valid range unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {valid}")


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def outer_lr_for(num_workers: int, momentum: float) -> float:
    """The outer learning rate for ``num_workers`` workers at outer ``momentum`` (Nesterov), when unset.

    Nesterov momentum mu multiplies a steady outer step by 1 / (1 - mu); the rule sets that effective
    step ``lr / (1 - mu)`` to ``1 + 0.2 * log2(M)``: 1 for one worker (plain training's step), 1.4 for
    4, 1.6 for 8. The mean of M workers' pseudo-gradients is shorter than each (they partly disagree),
    so the best step grows with M, but slowly: measured on the tiny model at H = 10, effective steps
    of 2 and more diverged or lost to 1.4 at M = 4, and 0.5 at momentum 0.5 was best for M = 1
    (docs/results.md). The scaling-law paper (arXiv 2503.09799) finds the same growth with M.
    """
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} is invalid: expected an integer >= 1")
    return (1 + 0.2 * math.log2(num_workers)) * (1 - momentum)


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    inner_steps: int = 500
    """H: inner optimizer steps between two outer rounds (the paper's 500)."""
    outer_lr: float | None = None
    """Learning rate of the outer SGD (1.0 with momentum 0 is plain averaging). Unset: chosen by the number
    of workers M at construction, ``outer_lr_for(M, outer_momentum)`` (docs/results.md has the sweep
    behind the rule). A transport whose peers come and go knows no M up front: set it there. Eager updates
    take the rule's value for M = 1 (the others' shares arrive a round late: 0.5 beat 0.7 and 0.35 at M = 4)."""
    outer_momentum: float = 0.5
    """Momentum of the outer SGD. The paper's 0.9 (with lr 0.7) needs hundreds of rounds to pay off; 0.5
    was best in our sweep at H = 10-50 and stays stable with the unset-lr rule (docs/results.md)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD. With momentum 0 both forms are the same plain SGD step."""
    codec: str = "fp32"
    """The codec the pseudo-gradients travel in (``diloco_core.codecs.CODECS``): fp32, fp16 or bf16 (casts),
    int8, int4 or sign (``codec_block`` values per fp32 scale). Sums are always accumulated in fp32."""
    wire_dtype: str | None = field(default=None, repr=False, compare=False)
    """Deprecated alias of ``codec`` (int4 and sign are not dtypes): given, it sets ``codec`` and warns."""
    codec_block: int = 256
    """Values per scale of the int8, int4 and sign codecs: a power of two in [16, 65536] ([32, 65536] for sign)."""
    error_feedback: bool = True
    """Add what a lossy codec dropped of this worker's pseudo-gradients to its next one (not for fp32).
    Saved in ``DiLoCo.state_dict()``; not served to joiners, who start from a zero residual."""
    reduce_timeout: float = 600.0
    """Seconds an outer all-reduce (or the initial broadcast) may take before TransportError."""
    round_retries: int = 2
    """Times ``step()`` retries a round whose all-reduce failed (a peer left: the survivors regroup)
    before the TransportError reaches the caller. Nothing changes until a round succeeds."""
    norm_clip: float | None = None
    """The norm guard (``diloco_core.guard``): clip each worker's pseudo-gradient, and the round's mean, to
    this many times their norms in the last round it did not clip. Unset: off. A number > 1 (e.g. 4)."""
    overlap: str = "none"
    """One of ``OVERLAP_MODES``: ``none`` (every worker waits for the round's mean), ``streaming`` or ``eager``."""
    fragments: int = 1
    """Streaming: P, the fragments synchronized one after another, every ``inner_steps // P`` steps (strided
    blocks of the model: block i in fragment i % P; an integer in [1, inner_steps])."""
    overlap_steps: int = 0
    """Streaming: tau, inner steps a fragment's reduce runs behind before its outer step is applied (an integer
    in [0, inner_steps - 1]; 0 waits at once)."""
    merge_alpha: float = 0.0
    """Streaming: a synced fragment becomes ``alpha * local + (1 - alpha) * global`` (0: the global params)."""
    eager_fresh_weight: float | None = None
    """Eager: w in (0, 1], how much of the change in this worker's own pseudo-gradient since the last round it
    adds to the round-old mean: it steps with Δ̄(t-1) + w (Δ_m(t) - Δ_m(t-1)); 1 / M is the paper's rule.
    Unset: max(0.5, 1 / M), the paper's for M <= 2; at M = 4 it lost 2.3% to blocking, 1 / M 3.9% (docs/overlap.md)."""
    global_device: str = "cpu"
    """Where the fp32 global copy and the outer optimizer state live (CPU saves accelerator memory)."""

    def __post_init__(self) -> None:
        h = self.inner_steps
        check_field("inner_steps", h, isinstance(h, int) and not isinstance(h, bool) and h >= 1, "an integer >= 1")
        lr = self.outer_lr
        check_field("outer_lr", lr, lr is None or (is_finite_number(lr) and lr > 0), "a finite number > 0 (or unset)")
        mom = self.outer_momentum
        check_field("outer_momentum", mom, is_finite_number(mom) and 0 <= mom < 1, "a number in [0, 1)")
        check_field("nesterov", self.nesterov, isinstance(self.nesterov, bool), "true or false")
        if self.wire_dtype is not None:
            msg = f"wire_dtype={self.wire_dtype!r} is deprecated: use codec={self.wire_dtype!r} (the same names)"
            warnings.warn(msg, DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "codec", self.wire_dtype)
            object.__setattr__(self, "wire_dtype", None)
        check_field("codec", self.codec, self.codec in CODECS, f"one of {sorted(CODECS)}")
        check_block(self.codec_block, "codec_block")
        ok = self.codec != "sign" or self.codec_block >= 32
        check_field("codec_block", self.codec_block, ok, "a power of two in [32, 65536] for codec='sign'")
        check_field("error_feedback", self.error_feedback, isinstance(self.error_feedback, bool), "true or false")
        t = self.reduce_timeout
        check_field("reduce_timeout", t, is_finite_number(t) and t > 0, "a finite number of seconds > 0")
        r = self.round_retries
        check_field("round_retries", r, isinstance(r, int) and not isinstance(r, bool) and r >= 0, "an integer >= 0")
        k = self.norm_clip
        check_field("norm_clip", k, k is None or (is_finite_number(k) and k > 1), "a finite number > 1 (or unset)")
        self._check_overlap()
        check_field("global_device", self.global_device, isinstance(self.global_device, str), "a torch device string")
        try:
            import torch

            torch.device(self.global_device)
        except RuntimeError as e:
            raise ValueError(f"global_device={self.global_device!r} is invalid: {e}") from None

    def _check_overlap(self) -> None:
        mode, h, p, tau, alpha = self.overlap, self.inner_steps, self.fragments, self.overlap_steps, self.merge_alpha
        check_field("overlap", mode, mode in OVERLAP_MODES, f"one of {list(OVERLAP_MODES)}")
        is_int = isinstance(p, int) and not isinstance(p, bool)
        check_field("fragments", p, is_int and 1 <= p <= h, f"an integer in [1, inner_steps={h}]")
        is_int = isinstance(tau, int) and not isinstance(tau, bool)
        check_field("overlap_steps", tau, is_int and 0 <= tau < h, f"an integer in [0, inner_steps - 1 = {h - 1}]")
        check_field("merge_alpha", alpha, is_finite_number(alpha) and 0 <= alpha <= 1, "a number in [0, 1]")
        w = self.eager_fresh_weight
        is_w = w is None or (is_finite_number(w) and 0 < w <= 1)
        check_field("eager_fresh_weight", w, is_w, "a number in (0, 1] (or unset)")
        if mode != "eager" and w is not None:
            raise ValueError(
                f"eager_fresh_weight={w:g} is eager's setting: set overlap='eager' or leave it unset (overlap={mode!r})"
            )
        if mode != "streaming" and (p, tau, alpha) != (1, 0, 0):
            raise ValueError(
                f"fragments={p}, overlap_steps={tau}, merge_alpha={alpha:g} are streaming's settings: "
                f"set overlap='streaming' or leave them at 1, 0, 0 (overlap={mode!r})"
            )


def from_mapping(cls: type, section: Mapping[str, Any], where: str) -> Any:
    """Build the dataclass ``cls`` from a config section, rejecting unknown keys with the valid ones."""
    if not isinstance(section, Mapping):
        raise ValueError(f"[{where}] must be a table of key = value, got {type(section).__name__}")
    valid = [f.name for f in fields(cls) if f.init]
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in [{where}]; valid keys: {valid}")
    try:
        return cls(**section)
    except ValueError as e:
        raise ValueError(f"[{where}] {e}") from None

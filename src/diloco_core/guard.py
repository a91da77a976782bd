"""The contribution guard: what one worker sends cannot poison the round's mean.

- **Exclusion** (always on): a pseudo-gradient holding NaN or infinite values, or values its wire cannot
  carry (fp16 past 65504, and error feedback's residual on top), is not sent: the worker sends zeros and
  a valid flag of 0. The flag rides in the round's own reduce, in a codec block it fills after the
  pseudo-gradient, so every worker reads how many contributions were valid with no extra round trip and
  divides the sum by that number (the transport's mean times contributors / valid). The excluded worker
  takes the round's global params like the others; its error-feedback residual is kept, not updated. No
  valid contribution at all: no outer step, the global params and outer momentum stay as they were.
- **Norm guard** (``DiLoCoConfig.norm_clip = k``, off by default): each worker clips its own
  pseudo-gradient to k times the contributors' mean norm of the last round the guard did not clip (an
  honest outlier), and every worker clips the round's mean to k times the median of the mean's norm over
  the last ``WINDOW`` rounds it did not clip (an insider who sends a huge finite contribution, whatever its
  own software does): honest rounds move it either way, a clipped round never, so an attack cannot raise its
  own limit. Where there is a majority the robust merge (``merge.py``) leaves such an insider out first.
  The references come from reduced values, the same on every worker; they are in ``DiLoCo.state_dict()`` and
  the state served to joiners. Before the first unclipped round there is no reference: nothing is clipped.
- **Work** (``DiLoCoConfig.round_seconds``): a worker whose round held more or fewer inner steps than
  ``inner_steps`` sends its pseudo-gradient times its work w (its steps / ``inner_steps``, at most
  ``MAX_WORK``) and w - 1 in a block of the tail, so the reduce's sum over the valid contributions gives
  Σ w Δ and Σ w, and every worker divides one by the other: the token-weighted mean, in the same reduce.
  Where every worker did ``inner_steps`` steps, w - 1 is 0 on every wire and the arithmetic is the unit
  weights' (the mean over the valid contributions), bit for bit.
- **Replicas compared** (where ranks are fixed): each worker also sends a 4-bit digest h of its global
  params (a strided sample of 4,096 values, CRC-32) and h², each in a block of its own; all digests are
  equal exactly when M·Σh² = (Σh)² (integers every wire carries exactly, bf16 included), so every worker
  learns from the round's own reduce whether any
  replica differs, and all raise the same ``ValueError`` before anything changes. A replica that differs
  only outside the sample, or with the same digest (1 in 16), is caught in a later round.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass

import torch

from .codecs.base import Codec
from .control import ControlLayout
from .flat import norm_of

logger = logging.getLogger("diloco_core.diloco")


def reset_if_nonfinite(optimizer: torch.optim.Optimizer, round: int) -> None:
    """An excluded worker (its training diverged) restarts its inner optimizer if its moments hold NaN or inf."""
    tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        logger.warning("round %d: the inner optimizer's state is not finite: it starts afresh", round)
        optimizer.state.clear()


__all__ = ["MAX_WORK", "WINDOW", "ContributionGuard", "Tally", "reset_if_nonfinite"]

WINDOW = 9
"""Rounds whose mean norms the norm guard's reference is the median of."""
MAX_WORK = 4.0
"""The most work one contribution may weigh, in rounds of ``inner_steps`` steps: what a worker claims is
summed unseen (the tail is not judged), so one claim can shift the others' weights by this much at most."""


@dataclass(frozen=True)
class Tally:
    """What a round's reduce says of its contributions (``ContributionGuard.settle``)."""

    valid: int
    """Contributions averaged (0: no outer step)."""
    work: float
    """Their summed work, in rounds of ``inner_steps`` steps (``valid`` where each did that many)."""
    norm: float
    """Their work-weighted mean pseudo-gradient norm."""


class ContributionGuard:
    """One worker's guard over the flat reduce buffer ``[pseudo-gradient | pad | valid | work - 1 | digest |
    digest² | rms]``, each of the tail's values but the RMS a codec block of its own."""

    def __init__(self, codec: Codec, *, norm_clip: float | None, numel: int, compare: bool = True) -> None:
        self.codec, self.norm_clip, self.numel, self.compare = codec, norm_clip, numel, compare
        pad = -numel % codec.block
        self.valid_at = numel + pad
        """Where the valid flag sits: a codec block of its own, filled with it (the pseudo-gradient's last block
        padded as ``Codec.pad`` asks), which every codec carries as it is (the sign codec too: all values of
        one magnitude); the work, the digest and its square follow, a block each, then the RMS (a block of one)."""
        self.work_at = self.valid_at + codec.block
        self.digest_at = self.work_at + codec.block
        self.tail_size = pad + 4 * codec.block + 1
        """Values after the pseudo-gradient: padding, the blocks of the valid flag, the work, the digest and its
        square, the RMS (a block of one)."""
        self.controls = ControlLayout(
            valid_at=self.valid_at,
            work_at=self.work_at,
            digest_at=self.digest_at,
            block=codec.block,
            max_work=MAX_WORK,
        )
        """Where the control values sit, for the merge to judge them per contributor (``control.py``)."""
        self.ref_norm = 0.0
        """Contributors' mean pseudo-gradient norm in the last round the guard did not clip (0: none yet)."""
        self.digest = 0.0
        """This worker's digest in the round it last marked (``mark``): the merge corrects a minority's."""
        self.means: list[float] = []
        """The mean pseudo-gradient's norm in the last ``WINDOW`` rounds the guard did not clip (oldest first)."""

    def admit(self, pseudo_grad: torch.Tensor, norm: float) -> tuple[bool, bool, float]:
        """Before sending: (excluded, clipped, the norm sent). Clipping scales ``pseudo_grad`` in place."""
        if not math.isfinite(norm) or not self._fits(pseudo_grad, norm):
            return True, False, 0.0
        limit = (self.norm_clip or 0.0) * self.ref_norm
        if limit > 0 and norm > limit:
            pseudo_grad.mul_(limit / norm)
            return False, True, limit
        return False, False, norm

    def _fits(self, values: torch.Tensor, norm: float) -> bool:
        """Whether a cast wire carries every value (block codecs scale any finite value; fp32 is itself).
        No value exceeds the L2 norm, so below the wire's largest value no pass over the values is needed."""
        dtype = self.codec.elementwise_dtype
        if dtype is None or dtype == torch.float32 or values.numel() == 0 or norm <= torch.finfo(dtype).max:
            return True
        return bool(torch.maximum(values.amax(), values.amin().neg()).to(dtype).isfinite())

    def mark(
        self, flat: torch.Tensor, *, excluded: bool, norm: float, global_flat: torch.Tensor, work: float = 1.0
    ) -> None:
        """Write the tail: valid flag, ``work`` - 1, digest of ``global_flat`` and its square, RMS (of the values
        sent: ``norm`` times ``work``, the pseudo-gradient being sent times its work); an excluded worker's
        pseudo-gradient, flag, work and RMS are zeros (its digest still counts)."""
        block = self.codec.block
        if excluded:
            flat.zero_()
        else:  # the pad written again: the last mean left its decoded values there
            self.codec.pad(flat, self.numel)
            flat[self.valid_at : self.valid_at + block] = 1.0  # whole blocks of one value: every codec's exact
            flat[self.work_at : self.work_at + block] = work - 1.0
            flat[-1] = norm * work / math.sqrt(self.numel) if self.numel else 0.0
        sample = global_flat[:: max(1, global_flat.numel() // 4096)][:4096].detach().cpu()
        h = float(zlib.crc32(sample.numpy().tobytes()) % 16)
        self.digest = h
        flat[self.digest_at : self.digest_at + block] = h
        flat[self.digest_at + block : self.digest_at + 2 * block] = h * h

    def settle(self, flat: torch.Tensor, contributors: int) -> Tally:
        """After the reduce: check that the replicas agree (``ValueError`` if not, nothing changed), rescale
        the mean to the valid contributors' work (the mean over them where each did a round's). With none
        valid the buffer is left as it came (zeros)."""
        s1 = round(flat[self.digest_at].item() * contributors)  # the digests' sum, and their squares'
        s2 = round(flat[self.digest_at + self.codec.block].item() * contributors)
        if self.compare and contributors * s2 != s1 * s1:
            raise ValueError(
                f"the workers' global params differ (the round's digest check: {contributors} digests summing to "
                f"{s1}, their squares to {s2}): a replica diverged; nothing was changed. Resume every worker from "
                "the same checkpoint"
            )
        if self.compare and contributors and s1 != self.digest * contributors:  # the majority's, not mine
            raise ValueError(
                f"this worker's global params differ from the majority's (digest {self.digest:g}, theirs "
                f"{s1 // contributors}): this replica diverged and was named; nothing was changed here. Resume "
                "it from the others' newest checkpoint"
            )
        valid = min(contributors, max(0, round(flat[self.valid_at].item() * contributors)))
        work = valid + flat[self.work_at].item() * contributors  # exactly ``valid`` where every w - 1 is 0
        if work <= 0:  # only claims below a round's work, summed past the valid contributions: nothing to weigh
            valid = work = 0
        if valid and work != contributors:
            flat.mul_(contributors / work)
        return Tally(valid=valid, work=work, norm=flat[-1].item() * math.sqrt(self.numel))

    def clip_mean(self, mean: torch.Tensor, *, mean_norm: float, contributors_norm: float) -> tuple[bool, float]:
        """The norm guard on the mean (in place): (clipped, its norm now). An unclipped round becomes the
        reference for the next ones."""
        limit = (self.norm_clip or 0.0) * self.ref_mean
        if limit > 0 and mean_norm > limit:
            mean.mul_(limit / mean_norm)
            return True, norm_of(mean)
        self.ref_norm = contributors_norm
        self.means = [*self.means, mean_norm][-WINDOW:]
        return False, mean_norm

    @property
    def ref_mean(self) -> float:
        """The reference of the mean's norm: the median over ``means`` (the upper one of an even number)."""
        return sorted(self.means)[len(self.means) // 2] if self.means else 0.0

    def state_dict(self) -> dict[str, float | list[float]]:
        return {"ref_norm": self.ref_norm, "ref_mean": self.ref_mean, "means": list(self.means)}

    def load_state_dict(self, state: dict) -> None:
        """From ``state_dict()`` (or a peer's snapshot; one saved before ``means`` existed: its ``ref_mean``)."""
        refs = (state.get("ref_norm"), state.get("ref_mean")) if isinstance(state, dict) else (None, None)
        means = state.get("means", [refs[1]] if refs[1] else []) if isinstance(state, dict) else None
        numbers = [*refs, *means] if isinstance(means, list) and len(means) <= WINDOW else [None]
        if not all(isinstance(r, (int, float)) and math.isfinite(r) and r >= 0 for r in numbers):
            raise ValueError(
                f"the contribution guard's references must be finite numbers >= 0 (at most {WINDOW} means), "
                f"got {state!r}"
            )
        self.ref_norm, self.means = float(refs[0]), [float(m) for m in means]

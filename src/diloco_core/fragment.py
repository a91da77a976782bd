"""A fragment: a part of the model whose outer round runs on its own (the whole model unless streaming)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codecs.base import Codec
from .config import DiLoCoConfig
from .directions import Directions, sent_size
from .feedback import ErrorFeedback
from .flat import FlatBuffer, norm_of
from .guard import ContributionGuard
from .merge import Merge, MergeRule
from .transport import ReduceHandle, ReduceResult, Transport

__all__ = ["Fragment", "Settled", "cut"]


@dataclass(frozen=True)
class Settled:
    """A fragment's reduce once its mean is in the fragment's reduce buffer, before the outer step uses it."""

    result: ReduceResult
    valid: int
    """Contributions averaged (``ContributionGuard.settle``); 0: no outer step."""
    contributors_norm: float
    """The contributors' work-weighted mean pseudo-gradient norm (rode in the reduce)."""
    work: float = 0.0
    """The valid contributions' summed work, in rounds of ``inner_steps`` steps (rode in the reduce)."""


class Fragment:
    """Fragment ``index``: the local tensors it synchronizes (``local``), its contiguous slice ``flat`` of
    the global copy (``views``: one per tensor), and its reduce buffer ``[pseudo-gradient | guard tail]``
    (``reduce``; RDA: ``[directions | norms | guard tail]``) with its own contribution guard and error-feedback
    residual. ``param`` is its outer parameter: the global slice, whose gradient is the reduced mean."""

    def __init__(
        self,
        key: str,
        *,
        local: Sequence[torch.Tensor],
        flat: torch.Tensor,
        views: Sequence[torch.Tensor],
        codec: Codec,
        norm_clip: float | None,
        error_feedback: bool,
        compare: bool,
        merge: Merge,
        rda: bool = False,
    ) -> None:
        """``merge``: how the contributions are merged; it judges the pseudo-gradient, never the guard's tail.
        ``rda``: the pseudo-gradient travels as directions and norms (``diloco_core.directions``)."""
        self.key, self.local, self.flat, self.views, self.codec = key, list(local), flat, list(views), codec
        n = flat.numel()
        judged = sent_size(n, tensors=len(self.local), block=codec.block) if rda else n  # the values judged
        self.guard = ContributionGuard(codec, norm_clip=norm_clip, numel=judged, compare=compare)
        self.reduce = FlatBuffer(self.local, flat.device, extra=judged - n + self.guard.tail_size)
        self.directions = Directions(self.reduce, codec) if rda else None
        apart = self.directions.at if self.directions else None
        self.merge = dataclasses.replace(merge, judged=judged, apart=apart, controls=self.guard.controls)
        self.feedback = ErrorFeedback(codec, self.reduce.flat, fed=n, on=error_feedback)
        self.param = torch.nn.Parameter(flat, requires_grad=False)
        self.param.grad = self.reduce.body

    def pseudo_gradient(self, start: torch.Tensor | None = None) -> tuple[float, bool, bool, float]:
        """``start - local`` (``start``: this fragment's global slice unless given) into the reduce buffer's
        body, passed through the guard: (its norm, excluded, clipped, the norm sent)."""
        pg = self.reduce.body
        self.reduce.copy_from(self.local)
        torch.sub(self.flat if start is None else start, pg, out=pg)
        norm = norm_of(pg)
        excluded, clipped, sent_norm = self.guard.admit(pg, norm)
        if self.directions is not None and not excluded:
            self.directions.split()
        return norm, excluded, clipped, sent_norm

    def send(
        self, transport: Transport, *, excluded: bool, norm: float, work: float = 1.0
    ) -> tuple[ReduceHandle, bool]:
        """Start the reduce of the body times ``work`` (this worker's, in rounds of ``inner_steps`` steps: the
        guard's weighted mean), error feedback added, the guard's tail written: (its handle, excluded, now also
        when the residual took a value past what the wire carries)."""
        flat = self.reduce.flat
        if work != 1.0 and not excluded:
            flat[: self.guard.numel].mul_(work)  # RDA's norms too
        # the tail first: the residual is what the codec drops of the very values sent (its blocks at the pad)
        self.guard.mark(flat, excluded=excluded, norm=norm, global_flat=self.flat, work=work)
        if not excluded:
            try:
                self.feedback.feed(flat)  # the norm is the pseudo-gradient's own, without the residual
            except ValueError:  # with the residual, past what the wire carries (fp16)
                excluded = True
                self.guard.mark(flat, excluded=True, norm=norm, global_flat=self.flat, work=work)
        return transport.all_reduce([flat], codec=self.codec, key=self.key, merge=self.merge), excluded

    def settle(self, result: ReduceResult, *, excluded: bool) -> Settled:
        """After the reduce: the mean rescaled to the valid contributions, the residual committed."""
        tally = self.guard.settle(self.reduce.flat, result.num_contributors)
        if self.directions is not None:
            self.directions.join()
        if not excluded:  # an excluded worker still owes the residual it had
            self.feedback.commit()
        return Settled(result=result, valid=tally.valid, contributors_norm=tally.norm, work=tally.work)

    def clip_mean(self, settled: Settled) -> tuple[bool, float]:
        """The norm guard on the mean (when any contribution was valid): (clipped, the mean's norm)."""
        mean_norm = norm_of(self.reduce.body)
        if not settled.valid:
            return False, mean_norm
        return self.guard.clip_mean(self.reduce.body, mean_norm=mean_norm, contributors_norm=settled.contributors_norm)

    def load_global(self, alpha: float = 0.0) -> None:
        """The model's tensors of this fragment become ``alpha * local + (1 - alpha) * global``."""
        if alpha == 0:
            torch._foreach_copy_(self.local, self.views)
        else:
            torch._foreach_lerp_(self.local, self.views, 1 - alpha)


def cut(
    groups: list[list[int]],
    local: Sequence[torch.Tensor],
    buffer: FlatBuffer,
    *,
    codec: Codec,
    config: DiLoCoConfig,
    compare: bool,
) -> list[Fragment]:
    """The fragments of ``groups`` (indices into ``local``), their slices of ``buffer`` (the global copy, which
    holds ``local[i]`` for i in the groups' order)."""
    fragments, start, first = [], 0, 0
    for p, g in enumerate(groups):
        n = sum(local[i].numel() for i in g)
        key = "diloco/round" if len(groups) == 1 else f"diloco/fragment/{p}"
        fragments.append(
            Fragment(
                key,
                local=[local[i] for i in g],
                flat=buffer.flat[start : start + n],
                views=buffer.views[first : first + len(g)],
                codec=codec,
                norm_clip=config.norm_clip,
                error_feedback=config.error_feedback,
                compare=compare,
                merge=Merge(rule=MergeRule(config.merge), outlier_ratio=config.outlier_ratio),
                rda=config.rda,
            )
        )
        start, first = start + n, first + len(g)
    return fragments

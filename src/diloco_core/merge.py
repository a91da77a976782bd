"""The merge: how the contributions of a reduce become its result. Every transport runs it where it holds the
received payloads (in-process once for the group; torch on every rank, or per shard; hivemind per part, on the
part's reducer), so this is the one place a rule is written.

- ``MergeRule.MEAN``: the fp32 mean of the decoded payloads, summed in contributor order (``Codec.mean_of``: the
  wire contract ``reference_mean`` writes plainly).
- ``MergeRule.ROBUST`` (DiLoCo's default): a contribution far from the others, or pointing away from them, is
  left out. Over the values the rule judges, the centre is the coordinate-wise median of the decoded
  contributions; a contribution whose L2 distance to it is more than ``outlier_ratio`` times the median
  distance (a scaled update), or whose cosine with it is negative (a flipped one, whatever its norm), is left
  out, and the judged values are the mean of the rest. With fewer than 3
  contributors there is no majority and nothing is left out. Where none is left out (every honest round) the
  result is ``MEAN``'s, bit for bit. A contribution left out can pull the result by nothing; one kept can pull
  it by at most ``outlier_ratio`` times the median distance divided by the contributors: bounded influence.

A merge judges the values before ``judged`` (the pseudo-gradient); values from ``judged`` on (the contribution
guard's tail: flags, digests) are always the plain mean over every contributor, as the guard's arithmetic needs.
A transport that merges a slice of the values on its own says where the slice starts (``start``); a slice
judges its own values, so on a transport that cuts the values into parts (hivemind, torch with more than 3
ranks) an outlier is left out of the parts where it is one.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codecs.base import Codec

__all__ = ["MEAN", "LeftOut", "Merge", "MergeRule", "combined"]

MIN_JUDGED = 8
"""Values a slice needs before its contributions are judged: a distance over fewer says little."""


class MergeRule(enum.Enum):
    MEAN = "mean"
    ROBUST = "robust"


@dataclass(frozen=True)
class LeftOut:
    """A contribution the merge left out: who sent it (as the transport names its contributors), its distance to
    the centre over the median distance (``inf`` where the others agree exactly), and its cosine with the centre."""

    who: str
    ratio: float
    cosine: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Merge:
    rule: MergeRule = MergeRule.MEAN
    judged: int | None = None
    """Values (from the start of the reduced tensors) the rule judges; the rest are plain means. None: all."""
    outlier_ratio: float = 3.0
    """``ROBUST``: a contribution further than this times the median distance from the centre is left out."""

    def of(
        self,
        payloads: Sequence[torch.Tensor],
        *,
        codec: Codec,
        out: torch.Tensor,
        scratch: torch.Tensor | None = None,
        start: int = 0,
        who: Sequence[str] = (),
    ) -> tuple[LeftOut, ...]:
        """``out`` (fp32, flat) = the merge of ``payloads`` (``codec``'s, of ``out.numel()`` values that begin at
        value ``start`` of the reduced tensors), in the given order. Returns the contributions left out, named by
        ``who`` (one name per payload; their index where not given)."""
        assert payloads, "a merge needs at least one contribution"
        n = out.numel()
        judged = n if self.judged is None else max(0, min(n, self.judged - start))
        if self.rule is MergeRule.MEAN or len(payloads) < 3 or judged < MIN_JUDGED:
            codec.mean_of(payloads, out, scratch)
            return ()
        decoded = torch.empty(len(payloads), n, dtype=torch.float32, device=out.device)
        for p, row in zip(payloads, decoded):
            codec.decode(p, row)
        gone = self._outliers(decoded[:, :judged])
        codec.mean_of(payloads, out, scratch)
        if gone:
            kept = [row for i, row in enumerate(decoded) if i not in gone]
            body = out[:judged].copy_(kept[0][:judged])
            for row in kept[1:]:
                body.add_(row[:judged])
            body.div_(len(kept))
        names = list(who) or [str(i) for i in range(len(payloads))]
        return tuple(LeftOut(names[i], ratio, cosine) for i, (ratio, cosine) in gone.items())

    def _outliers(self, values: torch.Tensor) -> dict[int, tuple[float, float]]:
        """The rows of ``values`` (one per contribution) further than ``outlier_ratio`` times the median distance
        from the coordinate-wise median, or at a negative cosine with it: their index, (that ratio, cosine)."""
        k = values.shape[0]
        centre = _median(values)
        distances = [float(torch.linalg.vector_norm(row - centre)) for row in values]
        typical = sorted(distances)[k // 2]
        ratios = [d / typical if typical > 0 else (float("inf") if d > 0 else 1.0) for d in distances]
        scale = float(torch.linalg.vector_norm(centre)) * torch.linalg.vector_norm(values, dim=1)
        dots = (values @ centre).tolist()  # a zero row or centre: no direction to judge (cosine 1)
        cosines = [dot / n if n > 0 else 1.0 for dot, n in zip(dots, scale.tolist())]
        return {
            i: (ratio, cosine)
            for i, (ratio, cosine) in enumerate(zip(ratios, cosines))
            if ratio > self.outlier_ratio or cosine < 0
        }


def combined(left_out: Sequence[LeftOut]) -> tuple[LeftOut, ...]:
    """One entry per contributor left out of any slice (their largest ratio, lowest cosine), in the order first
    seen."""
    worst: dict[str, LeftOut] = {}
    for o in left_out:
        seen = worst.get(o.who, o)
        worst[o.who] = LeftOut(o.who, max(o.ratio, seen.ratio), min(o.cosine, seen.cosine))
    return tuple(worst.values())


def _median(values: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of the rows (the mean of the middle two for an even number): for 3 and 4 rows
    without a sort, which would allocate an int64 index per value."""
    k = values.shape[0]
    if k in (3, 4):
        rest = values.sum(dim=0).sub_(values.amax(dim=0)).sub_(values.amin(dim=0))
        return rest if k == 3 else rest.div_(2)
    ordered = values.sort(dim=0).values
    return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2


MEAN = Merge()
"""The plain mean over every value (buffers, agreement checks)."""

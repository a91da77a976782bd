"""The merge: how the contributions of a reduce become its result. Every transport runs it where it holds the
received payloads (in-process once for the group; torch on every rank, or per shard; hivemind per part, on the
part's reducer), so this is the one place a rule is written.

- ``MergeRule.MEAN``: the fp32 mean of the decoded payloads, summed in contributor order (``Codec.mean_of``: the
  wire contract ``reference_mean`` writes plainly).
- ``MergeRule.ROBUST`` (DiLoCo's default): a contribution far from the others, or pointing away from them, is
  left out. Over the values the rule judges, each contribution's *spread* is its L2 distance to the farthest of
  the ⌊K/2⌋ other contributions nearest to it (with it, a majority of the K); one whose spread is more than
  ``outlier_ratio`` times the median spread (a scaled update), or then whose cosine is negative with a majority
  of those left (a flipped one, whatever its norm), is left out, and the judged values are the mean of the rest.
  All of it comes from the contributions' Gram matrix, one pass over them. A contribution of zeros abstains (the
  guard's exclusion): it is not judged, and the mean of those kept counts it as the plain mean does, so the
  guard's rescale to the valid contributors gives the kept ones' mean. With fewer than 3 that sent values there
  is no majority and nothing is left out; a majority is never left out. Where none is left out (every honest
  round) the result is ``MEAN``'s, bit for bit. A contribution left out moves the result by nothing; one kept
  is within ``outlier_ratio`` median spreads of a majority and does not point away from it: bounded influence.

A merge judges the values before ``judged`` (the pseudo-gradient), those from ``apart`` on apart from those
before (RDA's norms after its directions); values from ``judged`` on (the contribution guard's tail: flags,
digests) are always the plain mean over every contributor, as the guard's arithmetic needs. A transport that
merges a slice of the values on its own says where the slice starts (``start``); a slice judges its own values,
so on a transport that cuts the values into parts (hivemind, torch on its scatter-gather path) an outlier is left
out of the parts where it is one.

A contribution's weight is shaped in three places, one home each: its work (``guard.py``: w Δ sent, divided by
Σ w), this rule (left out or not), and RDA (``directions.py``: each tensor's norm and direction averaged apart).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .codecs.base import Codec

__all__ = ["MEAN", "LeftOut", "Merge", "MergeRule", "combined"]

MIN_JUDGED = 8
"""Values a slice needs before its contributions are judged: a distance over fewer says little."""
CHUNK = 2**15
"""Values per contribution in one piece of the Gram matrix's pass (3 contributions: 384 KB, in cache)."""


class MergeRule(enum.Enum):
    MEAN = "mean"
    ROBUST = "robust"


@dataclass(frozen=True)
class LeftOut:
    """A contribution the merge left out: who sent it (as the transport names its contributors), its spread over
    the median spread (``inf`` where the others agree exactly), and its lowest cosine with another."""

    who: str
    ratio: float
    cosine: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Merge:
    rule: MergeRule = MergeRule.MEAN
    judged: int | None = None
    """Values (from the start of the reduced tensors) the rule judges; the rest are plain means. None: all."""
    apart: int | None = None
    """Where the judged values' second slice begins, judged on its own (RDA's norms: ``directions``)."""
    outlier_ratio: float = 3.0
    """``ROBUST``: a contribution whose spread is more than this times the median spread is left out."""

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
        n, k = out.numel(), len(payloads)
        end = n + start if self.judged is None else self.judged
        apart, judged = (max(0, min(n, e - start)) for e in (self.apart or 0, end))
        verdicts = []  # (lo, hi, left out, how many sent any value): each slice judged by its own values
        for lo, hi in ((0, apart), (apart, judged)):
            if self.rule is MergeRule.ROBUST and k >= 3 and hi - lo >= MIN_JUDGED:
                pieces = codec.pieces(payloads, n, span=range(lo, hi), size=CHUNK)
                verdicts.append((lo, hi, *self._outliers(pieces, k=k)))
        codec.mean_of(payloads, out, scratch)
        names, left_out = list(who) or [str(i) for i in range(k)], []
        for lo, hi, gone, sent in verdicts:
            if gone:  # the slice's values: the mean of those kept (an attacked round; the tail stays everyone's)
                kept = [p for i, p in enumerate(payloads) if i not in gone]
                body = codec.mean_of(kept, torch.empty_like(out), scratch)[lo:hi]
                if sent < k:  # as the plain mean would count those kept that sent anything: the guard's rescale
                    body.mul_(len(kept) * sent / ((sent - len(gone)) * k))  # (contributors / valid) gives their mean
                out[lo:hi] = body
            left_out += [LeftOut(names[i], ratio, cosine) for i, (ratio, cosine) in gone.items()]
        return combined(left_out)

    def _outliers(self, pieces: Iterable[torch.Tensor], *, k: int) -> tuple[dict[int, tuple[float, float]], int]:
        """The ``k`` contributions far from the others or pointing away from them (their index: (ratio, cosine)),
        and how many sent values at all (the others, all zeros, abstain: the guard's exclusions). From their Gram
        matrix, summed over their decoded ``pieces`` (``Codec.pieces``: one pass in cache-sized pieces): each
        one's distance to the others (its nearest half's farthest), and its cosines with them."""
        gram = torch.zeros(k, k, dtype=torch.float64)
        for piece in pieces:
            gram += (piece @ piece.T).double()
        sent = [i for i in range(k) if gram[i, i] > 0]
        m, gram = len(sent), gram[sent][:, sent]
        if m < 3:  # no majority among those that sent anything
            return {}, m
        sq = gram.diagonal()
        dist = (sq[:, None] + sq[None, :] - 2 * gram).clamp_(min=0).sqrt_()
        cos = gram / (sq.sqrt()[:, None] * sq.sqrt()[None, :])
        nearest = m // 2 - 1  # with itself and this many more of the others nearest to it: a majority
        spread = [float(dist[i, [j for j in range(m) if j != i]].sort().values[nearest]) for i in range(m)]
        typical = sorted(spread)[m // 2]  # fewer than half are above it: at most a minority is far
        ratios = [s / typical if typical > 0 else (float("inf") if s > 0 else 1.0) for s in spread]
        cosines = [min(float(cos[i, j]) for j in range(m) if j != i) for i in range(m)]
        far = [i for i in range(m) if ratios[i] > self.outlier_ratio]
        # Then the direction, among those near (a scaled copy of one would vote against the others): pointing
        # away from a majority of them; never a majority of all (unrelated contributions, no consensus to judge by).
        near = [i for i in range(m) if i not in far]
        away = [i for i in near if sum(float(cos[i, j]) < 0 for j in near if j != i) > (len(near) - 1) / 2]
        gone = far + away if len(far) + len(away) <= (m - 1) // 2 else far
        return {sent[i]: (ratios[i], cosines[i]) for i in sorted(gone)}, m


def combined(left_out: Sequence[LeftOut]) -> tuple[LeftOut, ...]:
    """One entry per contributor left out of any slice (their largest ratio, lowest cosine), in the order first
    seen."""
    worst: dict[str, LeftOut] = {}
    for o in left_out:
        seen = worst.get(o.who, o)
        worst[o.who] = LeftOut(o.who, max(o.ratio, seen.ratio), min(o.cosine, seen.cosine))
    return tuple(worst.values())


MEAN = Merge()
"""The plain mean over every value (buffers, agreement checks)."""

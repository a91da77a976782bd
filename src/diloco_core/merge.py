"""The merge: how the contributions of a reduce become its result. Every transport runs it where it holds the
received payloads (in-process once for the group; torch on every rank, or per shard; hivemind per part, on the
part's reducer), so this is the one place a rule is written.

- ``MergeRule.MEAN``: the fp32 mean of the decoded payloads, summed in contributor order (``Codec.mean_of``: the
  wire contract ``reference_mean`` writes plainly).
- ``MergeRule.ROBUST`` (DiLoCo's default): honest diversity is kept and every contribution's
  influence bounded; only what is far *and* looks like an attack is left out (``judge.py``, from
  the contributions' Gram matrix, one pass over them). A contribution's *spread* is its L2 distance
  to the farthest of the ⌊K/2⌋ others nearest to it; the *centre* is the mean of the tightest
  majority; one farther from the centre than ``outlier_ratio`` median spreads (the radius; less
  where it points away from the centre) is clipped to it, so it moves the result by at most
  radius / K, and the result is the clipped contributions' mean (a weighted combination of the
  payloads). Left out (named: ``LeftOut``, what hivemind's strikes count) is only one beyond the
  radius that is flipped (a negative cosine with the centre) or scaled by orders of magnitude (over
  ``judge.SCALED`` times the median norm); a clip is never a ``LeftOut`` (a DEBUG line of this
  module names it). A contribution of zeros abstains (the guard's exclusion): it is not judged, and
  the result counts it as the plain mean does, so the guard's rescale to the valid contributors
  gives the kept ones' combination. With two that sent values there is no majority: nothing is
  left out, but the larger norm is clipped to ``outlier_ratio`` times the smaller (a group of two,
  a swarm's first round: ``judge._pair``); a majority is never left out. Where none is clipped or left out (every round
  of the default run and of the honest non-IID benchmark measured) the result is ``MEAN``'s, bit
  for bit.

A merge judges the values before ``judged`` (the pseudo-gradient), those from ``apart`` on apart from those
before (RDA's norms after its directions); values from ``judged`` on (the contribution guard's tail: flags,
digests) are always the plain mean over every contributor, as the guard's arithmetic needs. A transport that
merges a slice of the values on its own says where the slice starts (``start``); a slice judges its own values,
so on a transport that cuts the values into parts (hivemind, torch on its scatter-gather path) an outlier is left
out of the parts where it is one.

A contribution's weight is shaped in three places, one home each: its work (``guard.py``: w Δ sent, divided by
Σ w), this rule (left out, clipped or not), and RDA (``directions.py``: each tensor's norm and
direction averaged apart).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codecs.base import Codec
from .control import ControlLayout, judge_controls
from .judge import Verdict, judge

__all__ = ["MEAN", "LeftOut", "Merge", "MergeRule", "combined"]

logger = logging.getLogger(__name__)

MIN_JUDGED = 8
"""Values a slice needs before its contributions are judged: a distance over fewer says little."""
CHUNK = 2**17
"""Values per contribution in one piece of the Gram matrix's pass (3 contributions: 1.5 MB, in cache; a piece's
calls cost more than its cache misses below: 2**15 took 1.3x (fp32) to 2x (int4) as long on 3 x 25M values)."""


class MergeRule(enum.Enum):
    MEAN = "mean"
    ROBUST = "robust"


@dataclass(frozen=True)
class LeftOut:
    """A contribution the merge left out: who sent it (as the transport names its contributors), its distance to
    the centre over the median spread (``inf`` where a majority agrees exactly), and its cosine with the centre."""

    who: str
    ratio: float
    cosine: float = 1.0
    why: str = ""
    """Empty: judged by its values (``ratio``, ``cosine``); else what was wrong with it (``control.py``)."""


@dataclass(frozen=True, kw_only=True)
class Merge:
    rule: MergeRule = MergeRule.MEAN
    judged: int | None = None
    """Values (from the start of the reduced tensors) the rule judges; the rest are plain means. None: all."""
    apart: int | None = None
    """Where the judged values' second slice begins, judged on its own (RDA's norms: ``directions``)."""
    outlier_ratio: float = 3.0
    """``ROBUST``: the radius, in median spreads, beyond which a contribution is clipped (``judge.py``)."""
    controls: ControlLayout | None = None
    """Where the guard's control values sit: judged per contributor whatever the rule (``control.py``)."""

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
        verdicts = []  # (lo, hi, verdict): each slice judged by its own values
        cast = codec.elementwise_dtype is not None  # its pieces are its values: mean them as they pass
        for lo, hi in ((0, apart), (apart, judged)):
            if self.rule is MergeRule.ROBUST and k >= 2 and hi - lo >= MIN_JUDGED:
                gram = torch.zeros(k, k, dtype=torch.float64)
                at = lo
                for piece in codec.pieces(payloads, n, span=range(lo, hi), size=CHUNK):
                    gram += (piece @ piece.T).double()
                    if cast:
                        _mean_rows(piece, out[at : at + piece.shape[1]])
                    at += piece.shape[1]
                verdicts.append((lo, hi, judge(gram, ratio=self.outlier_ratio)))
        cuts = [0, *(x for lo, hi, _ in verdicts for x in (lo, hi)), n] if cast else [0, n]
        for lo, hi in zip(cuts[::2], cuts[1::2]):  # the values no Gram pass meaned
            if hi > lo:
                part = None if scratch is None else scratch[lo:hi]
                codec.mean_of([p[lo:hi] for p in payloads] if cast else payloads, out[lo:hi], part)
        names = list(who) or [str(i) for i in range(k)]
        left_out = [
            o for v in verdicts for o in _apply(v, payloads, codec=codec, out=out, scratch=scratch, names=names)
        ]
        if self.controls is not None:
            named = self._judge_controls(payloads, codec=codec, out=out, start=start)
            left_out += [LeftOut(names[i], 1.0, why="control values") for i in sorted(named)]
        return combined(left_out)

    def _judge_controls(
        self, payloads: Sequence[torch.Tensor], *, codec: Codec, out: torch.Tensor, start: int
    ) -> set[int]:
        """The control values in ``out``'s slice, judged per contributor (``control.py``); where any was
        corrected, their mean again, in contributor order. The contributors corrected (their index)."""
        layout, n = self.controls, out.numel()
        lo, hi = max(start, layout.start), min(start + n, layout.end)
        if lo >= hi:
            return set()
        span = range(lo - start, hi - start)
        values = torch.cat([p.clone() for p in codec.pieces(payloads, n, span=span, size=CHUNK)], dim=1)
        named = judge_controls(values, layout, lo=lo)
        if named:
            total = values[0].clone()
            for row in values[1:]:
                total += row
            out[span.start : span.stop] = total / len(payloads)
        return named


def _apply(
    verdict: tuple[int, int, Verdict],
    payloads: Sequence[torch.Tensor],
    *,
    codec: Codec,
    out: torch.Tensor,
    scratch: torch.Tensor | None,
    names: Sequence[str],
) -> list[LeftOut]:
    """A slice's verdict ``(lo, hi, verdict)`` applied to ``out`` (everyone's mean so far); who it left out."""
    lo, hi, v = verdict
    k, n = len(payloads), out.numel()
    if v.weights is not None:  # some clipped: the weighted combination, as the plain mean counts abstainers
        w = (v.weights * (v.nonzero / k)).float()  # (times valid / contributors: the guard's rescale)
        at = lo
        for piece in codec.pieces(payloads, n, span=range(lo, hi), size=CHUNK):
            out[at : at + piece.shape[1]] = w @ piece
            at += piece.shape[1]
        logger.debug("merge: bounded, weights %s", dict(zip(names, v.weights.tolist())))
    elif v.gone:  # the slice's values: the mean of those kept (an attacked round; the tail stays everyone's)
        kept = [p for i, p in enumerate(payloads) if i not in v.gone]
        body = codec.mean_of(kept, torch.empty_like(out), scratch)[lo:hi]
        if v.nonzero < k:  # as the plain mean counts those kept that sent anything: the guard's rescale
            body.mul_(len(kept) * v.nonzero / ((v.nonzero - len(v.gone)) * k))  # (contributors / valid)
        out[lo:hi] = body
    return [LeftOut(names[i], ratio, cosine) for i, (ratio, cosine) in v.gone.items()]


def _mean_rows(piece: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the mean of ``piece``'s rows (decoded payloads) as ``Codec.mean_of`` computes it:
    summed in order, then divided (the same bits)."""
    if len(piece) > 1:
        torch.add(piece[0], piece[1], out=out)
    else:
        out.copy_(piece[0])
    for row in piece[2:]:
        out.add_(row)
    out.div_(len(piece))


def combined(left_out: Sequence[LeftOut]) -> tuple[LeftOut, ...]:
    """One entry per contributor left out of any slice (their largest ratio, lowest cosine), in the order first
    seen."""
    worst: dict[str, LeftOut] = {}
    for o in left_out:
        seen = worst.get(o.who, o)
        why = ", ".join(dict.fromkeys(w for w in (seen.why, o.why) if w))
        worst[o.who] = LeftOut(o.who, max(o.ratio, seen.ratio), min(o.cosine, seen.cosine), why)
    return tuple(worst.values())


MEAN = Merge()
"""The plain mean over every value (buffers, agreement checks)."""

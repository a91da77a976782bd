"""A contribution's control values, judged one contributor at a time where the merge holds the payloads.

The guard's tail (``guard.py``: valid flag, work - 1, digest, digest², RMS) is averaged with the round, and
every worker reads the round's counts from the means. Unjudged, one insider's tail wrecked, froze or stopped
the swarm through them: a work claim of -2.9999 scaled the mean by contributors / work = 30,000; a valid flag
of -2 summed the valid count to 0 in every round (no outer step for the whole run); a forged digest stopped
every fixed-rank worker with "a replica diverged". Here each contributor's values are read from its own
payload, and where one is not what an honest guard writes it is corrected before the mean and the contributor
named (the strikes count it):

- the valid flag: 0 or 1; any other is taken as 1 (its values are in the sum: counting it keeps the mean a mean
  of what was summed);
- the work claim w - 1: w in [0, ``MAX_WORK``] (clamped: a negative claim cancelled the others'
  work), and 0 where the flag is 0;
- the digest and its square: an integer in [0, 15] and its square, each judged on its own (a cut
  may fall between them); where a strict majority of the contributors hold one, a contributor
  holding another gets the majority's (a replica that differs is named instead of stopping
  everyone; with no majority, as between two, the guard still stops the round);
- the RMS: finite and >= 0 (else 0).

Each is the first value of its block, the one the guard reads (every codec keeps it, top-k included), judged
where it lies in the slice a transport merges. Where every contributor's values are what an honest guard writes, nothing is recomputed:
the mean is the codec's, bit for bit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass

import torch

__all__ = ["ControlLayout", "judge_controls"]

DIGESTS = 16
"""The digest's values: 0 to 15 (``guard.py``: CRC-32 of a sample, mod 16)."""
SQUARES = frozenset(d * d for d in range(DIGESTS))
TOLERANCE = 0.25
"""How far a codec may move a control value (block codecs scale each block: 13 comes back as 12.99...); the
guard rounds the means too."""


@dataclass(frozen=True)
class ControlLayout:
    """Where the control values sit in the reduced values (``ContributionGuard``'s tail)."""

    valid_at: int
    work_at: int
    digest_at: int
    block: int
    max_work: float

    @property
    def start(self) -> int:
        return self.valid_at

    @property
    def end(self) -> int:
        """One past the RMS, the last value."""
        return self.digest_at + 2 * self.block + 1


def _column(values: torch.Tensor, at: int, lo: int) -> torch.Tensor | None:
    """Each contributor's value ``at`` (a control block's first value: the one the guard reads, and the one
    every codec keeps, top-k's included) of ``values`` (contributors x the slice from ``lo``); None where the
    slice does not hold it."""
    return values[:, at - lo] if lo <= at < lo + values.shape[1] else None


def _near(value: float, target: float) -> bool:
    """Within what a codec's rounding moves a control value (int4 carries a block of 13 as 12.99...)."""
    return abs(value - target) <= TOLERANCE


def _integer(value: float) -> int | None:
    """The integer a decoded control value stands for; None if it stands for none."""
    nearest = round(value) if math.isfinite(value) else None
    return nearest if nearest is not None and _near(value, nearest) else None


def _fix(column: torch.Tensor | None, wanted: list[float | None], named: set[int]) -> None:
    """Each contributor's value set to its ``wanted`` one (None: its own is fine), the contributor named."""
    if column is None:
        return
    for i, value in enumerate(wanted):
        if value is not None:
            column[i] = value
            named.add(i)


def _majority(column: torch.Tensor | None, allowed: Container[int], named: set[int]) -> None:
    """Where a strict majority of the contributors hold one ``allowed`` integer in ``column``, each
    other contributor gets it and is named. Each column on its own: a transport's cut may fall
    between the digest's block and its square's (hivemind's parts did, with 4 peers, in every
    round), and each part judges what it holds; once both are the majority's, every contributor's
    square is its digest's."""
    if column is None:
        return
    held = [h if h in allowed else None for h in map(_integer, column.tolist())]
    common = Counter(h for h in held if h is not None).most_common(1)
    if common and 2 * common[0][1] > len(held):
        _fix(column, [float(common[0][0]) if h != common[0][0] else None for h in held], named)


def judge_controls(values: torch.Tensor, layout: ControlLayout, *, lo: int) -> set[int]:
    """Correct, in place, the control values of ``values`` (contributors x the decoded slice beginning at value
    ``lo``) that an honest guard never writes; the contributors named (their index)."""
    named: set[int] = set()
    valid = _column(values, layout.valid_at, lo)
    flags = [_integer(v) for v in valid.tolist()] if valid is not None else [1] * values.shape[0]
    _fix(valid, [None if f in (0, 1) else 1.0 for f in flags], named)
    work = _column(values, layout.work_at, lo)
    if work is not None:
        # w >= 0: an honest claim is steps / inner_steps, as little as 1 / inner_steps (elastic)
        low, high = -1.0, layout.max_work - 1.0
        wanted = []
        for w, f in zip(work.tolist(), flags):
            if f == 0:  # an excluded contribution weighs nothing: its claim is 0
                wanted.append(None if _near(w, 0.0) else 0.0)
            else:
                wanted.append(None if math.isfinite(w) and low <= w <= high else min(max(w, low), high))
        _fix(work, [0.0 if v is not None and not math.isfinite(v) else v for v in wanted], named)
    _majority(_column(values, layout.digest_at, lo), range(DIGESTS), named)
    _majority(_column(values, layout.digest_at + layout.block, lo), SQUARES, named)
    rms = _column(values, layout.end - 1, lo)
    if rms is not None:
        _fix(rms, [None if math.isfinite(r) and r >= 0 else 0.0 for r in rms.tolist()], named)
    return named

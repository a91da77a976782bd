"""The robust rule's judgement of one slice's contributions (merge.py runs it), from their Gram
matrix alone.

Honest contributions differ: workers on different data point different ways (two may even have a
negative cosine), and a worker whose learning rate is in another phase (a founder past its warm-up
beside joiners in theirs) sends an update several times the others' norm in much the same
direction. Neither is evidence of an attack, so neither is left out: the rule bounds every
contribution's influence instead, and leaves out only what is far outside the honest spread *and*
looks like an attack.

- **Spread**: each contribution's L2 distance to the farthest of the ⌊m/2⌋ others nearest to it
  (with it, a majority of the m that sent values); the median spread is the honest scale.
- **Centre**: the mean of the tightest majority (the contribution with the smallest spread and the
  ⌊m/2⌋ nearest it). A minority cannot move it far: each member is within two spreads of it.
- **Bounded**: a contribution farther from the centre than its radius (``ratio`` median spreads,
  times 1 + its cosine with the centre where that is negative: one pointing away gets less room,
  none at -1) counts as if it were on the sphere of that radius about the centre, in its own
  direction (clipped); the result is the centre plus the mean of the clipped offsets, so one
  contribution moves it by at most radius / m. Every distance, and the clipped mean's weights, come
  from the Gram matrix: the centre is a combination of the contributions.
- **Left out**: only a contribution beyond the radius that is also flipped (a negative cosine with
  the centre) or scaled by orders of magnitude (a norm over ``SCALED`` times the median norm); never
  a member of the centre, so never a majority. Measured on honest runs: docs/reliability.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SCALED", "Verdict", "judge"]

SCALED = 100.0
"""Beyond the radius, a contribution whose norm is more than this times the median norm is left out
(scaled by orders of magnitude): a learning rate's phase moves an honest norm one order at most."""


@dataclass(frozen=True)
class Verdict:
    """What the rule decided for a slice, contributions named by their index among the k."""

    gone: dict[int, tuple[float, float]]
    """Left out: (distance to the centre over the median spread, cosine with the centre)."""
    weights: torch.Tensor | None
    """Where one kept is clipped: each contribution's weight in the result (fp64; 0: left out, or
    sent nothing), summing to 1 over the kept ones that sent values (a pair: ``_pair``). None: their
    plain mean."""
    nonzero: int
    """Contributions holding any nonzero value (the others, all zeros, abstain: the guard's exclusion)."""


def judge(gram: torch.Tensor, *, ratio: float) -> Verdict:
    """The verdict on k contributions from their fp64 Gram matrix (k, k); radius: ``ratio``."""
    nonzero = torch.nonzero(gram.diagonal() > 0).flatten()
    m = len(nonzero)
    if m == 2:  # no majority: neither is judged, but neither weighs more than ``ratio`` times the other
        return _pair(gram, nonzero, ratio=ratio)
    if m < 3:
        return Verdict({}, None, m)
    g = gram[nonzero][:, nonzero]
    sq = g.diagonal()
    others = (sq[:, None] + sq[None, :] - 2 * g).clamp_(min=0).sqrt_().fill_diagonal_(float("inf"))
    spread = others.sort(dim=1).values[:, m // 2 - 1]
    typical = float(spread.sort().values[m // 2])  # fewer than half above it: a minority is far
    seed = spread.argmin().view(1)
    members = torch.cat([seed, others[seed[0]].argsort(stable=True)[: m // 2]])
    a = torch.zeros(m, dtype=torch.float64).index_fill_(0, members, 1 / len(members))
    ga = g @ a
    far = (sq - 2 * ga + a @ ga).clamp_(min=0).sqrt_() / typical  # 0 / 0: NaN, never far
    cos = ga / (sq * (a @ ga)).sqrt()
    out = (far > ratio) & ((cos < 0) | (sq.sqrt() > SCALED * sq.sqrt().median()))
    out[members] = False  # never a member of the centre: never a majority
    radius = ratio * (1 + cos.clamp(max=0))  # pointing away from the centre: less room, none at -1
    clipped = (far > radius) & ~out
    gone = {int(nonzero[i]): (float(far[i]), float(cos[i])) for i in torch.nonzero(out).flatten()}
    if not bool(clipped.any()):
        return Verdict(gone, None, m)
    lam = torch.where(clipped, radius / far, 1.0)[~out]  # the share of its offset each one keeps
    weights = torch.zeros(gram.shape[0], dtype=torch.float64)
    weights[nonzero[~out]] = lam / len(lam) + a[~out] * (1 - lam.mean())
    return Verdict(gone, weights, m)


def _pair(gram: torch.Tensor, nonzero: torch.Tensor, *, ratio: float) -> Verdict:
    """Two contributions (a group of two, a swarm's first round): with no majority nothing is left out, but the
    larger norm is clipped to ``ratio`` times the smaller, less where the two point apart (as ``judge``'s radius:
    ``ratio`` x (1 + cosine), never below the smaller's norm), so one insider moves the result by at most
    ``ratio`` honest steps, and a flipped one cancels the other instead of reversing it (it wrecked the swarm's
    start before: x-1e6 beside the founder; then, clipped to 3x, it stepped the founder back a step a round).
    The weights are the pair's mean with that clip (they sum to less than 1 where it clips); None where the
    norms are within the bound."""
    norms = gram.diagonal()[nonzero].sqrt()
    small, large = norms.min(), norms.max()
    cos = float(gram[nonzero[0], nonzero[1]] / (small * large))
    bound = max(1.0, ratio * (1 + min(cos, 0.0)))
    if large <= bound * small:
        return Verdict({}, None, 2)
    weights = torch.zeros(gram.shape[0], dtype=torch.float64)
    weights[nonzero] = torch.where(norms == large, bound * small / large, 1.0) / 2
    return Verdict({}, weights, 2)

"""Eager updates (arXiv 2502.12996): a round's reduce runs behind the next H inner steps.

At boundary t worker m has its fresh pseudo-gradient Δ_m(t) and the mean of the previous round's,
Δ̄(t-1) (its reduce ran during the last H steps). It steps its own outer parameters x_m with

    Δ̃_m = Δ̄(t-1) - Δ_m(t-1) / V + Δ_m(t) / M = (Δ_m(t) + Σ_{m'≠m} Δ_m'(t-1)) / M   (V = M contributors),

its fresh share in place of its stale share of the average, and starts the reduce of Δ_m(t). That is the
paper's rule; ours adds (w - 1/M) (Δ_m(t) - Δ_m(t-1)) (``eager_fresh_weight`` w; max(0.5, 1 / M) unless
set), at V = M Δ̃_m = Δ̄(t-1) + w (Δ_m(t) - Δ_m(t-1)), as if the others' pseudo-gradients had changed
partly as this worker's did; where either share was excluded, the paper's rule. So the workers' x_m differ
by their own fresh shares, by design. Beside x_m every worker keeps the consensus
global copy (the fragment's ``flat``), stepped with the plain delayed means Δ̄(t-1): it is the same on
every worker, and it is what the replica digest compares, what a resumed run checks, and what the model
becomes at ``DiLoCo.flush()`` (the end of training). x_m, its outer momentum and the share in flight are in
``DiLoCo.state_dict()``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from .fragment import Fragment
from .report import PendingRound, RoundReport
from .rounds import Rounds

__all__ = ["Eager"]


class Eager:
    """One worker's eager state: its outer parameters x (``flat``) with their own outer SGD, and the
    pseudo-gradient it last sent (``sent``, its share of the reduce in flight); it runs the boundaries of
    ``rounds``, whose one fragment is ``fragment``. Its SGD has the consensus outer SGD's settings
    (``outer``: lr, momentum, nesterov)."""

    def __init__(self, rounds: Rounds, *, fragment: Fragment, outer: dict[str, Any]) -> None:
        self.rounds = rounds
        self.fragment = fragment
        self.flat = rounds.global_clone()
        self.param = torch.nn.Parameter(self.flat, requires_grad=False)
        self.param.grad = torch.zeros_like(self.flat)
        self.optimizer = torch.optim.SGD([self.param], **outer, fused=True)
        self.sent = torch.zeros_like(self.flat)
        self.sent_valid = False
        """``sent`` went into the reduce in flight as a valid contribution (False: none in flight, or excluded)."""
        self.sent_norm = 0.0

    def outer_gradient(
        self, mean: torch.Tensor | None, fresh: torch.Tensor, *, valid: int, world: int, w: float, fresh_valid: bool
    ) -> torch.Tensor:
        """``param.grad`` = Δ̃: the previous round's ``mean`` (of ``valid`` contributions; None: no round yet)
        less this worker's stale share (``sent``, 1 / V of the mean) plus its ``fresh`` one (1 / M), both moved
        by (w - 1/M) (fresh - stale) where both are valid; before any mean, w * fresh (nothing sent yet)."""
        d = self.param.grad
        if mean is None:
            return d.copy_(fresh).mul_(w) if fresh_valid else d.zero_()
        if mean is not d:
            d.copy_(mean)
        stale = self.sent_valid and valid > 0
        if stale:  # w + 1/V - 1/M is w exactly at V = M
            d.sub_(self.sent, alpha=w + (1.0 / valid - 1.0 / world) if fresh_valid else 1.0 / valid)
        return d.add_(fresh, alpha=w if stale else 1.0 / world) if fresh_valid else d

    def reset(self) -> None:
        """x becomes the consensus global copy, with its momentum (a flush, or a joiner's start)."""
        self.flat.copy_(self.rounds.global_clone())
        mine = self.optimizer.state_dict()
        mine["state"] = {k: {"momentum_buffer": b} for k, b in enumerate(self.rounds.momentum())}
        self.optimizer.load_state_dict(mine)
        self.sent.zero_()
        self.sent_valid, self.sent_norm = False, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "x": self.flat,
            "optimizer": self.optimizer.state_dict(),
            "sent": self.sent,
            "sent_valid": self.sent_valid,
            "sent_norm": self.sent_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("x", "sent"):
            t = state[name]
            if not isinstance(t, torch.Tensor) or t.shape != self.flat.shape:
                raise ValueError(f"the saved eager state's {name!r} does not fit this model ({tuple(self.flat.shape)})")
        self.flat.copy_(state["x"])
        self.sent.copy_(state["sent"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sent_valid, self.sent_norm = bool(state["sent_valid"]), float(state["sent_norm"])

    @torch.no_grad()
    def boundary(self, retry: bool, fresh_weight: float | None) -> RoundReport:
        """Eager updates' boundary: settle the previous round's reduce (a retry sends the same share again), step
        the consensus copy with its mean and this worker's own params with Δ̃ (w: ``fresh_weight``, None: max(0.5,
        1 / M)), send the fresh pseudo-gradient."""
        r, f = self.rounds, self.fragment
        world = r.world_size
        start = time.perf_counter()
        last = r.in_flight[0] if r.in_flight else None
        if last is not None and retry and last.settled is None:
            f.reduce.body.copy_(self.sent)
            handle, _, buffers = r.send(0, excluded=not self.sent_valid, norm=self.sent_norm)
            last = r.swap(last, handle=handle, buffers=buffers)
        # applied (no longer in flight): a snapshot of the run state taken as the fresh reduce starts must not hold it
        last, mean_clipped, mean_norm = r.apply(last) if last is not None else (None, False, 0.0)
        settled = last.settled if last is not None else None
        mean = self.param.grad.copy_(f.reduce.body) if settled is not None else None  # held: the body is reused
        local_norm, excluded, clipped, sent_norm = f.pseudo_gradient(start=self.flat)
        valid = settled.valid if settled else 0
        w = max(0.5, 1 / world) if fresh_weight is None else fresh_weight  # 1 / M: the paper's rule
        self.outer_gradient(mean, f.reduce.body, valid=valid, world=world, w=w, fresh_valid=not excluded)
        self.optimizer.step()
        self.sent.copy_(f.reduce.body)
        handle, excluded, buffers = r.send(0, excluded=excluded, norm=sent_norm)
        self.sent_valid, self.sent_norm = not excluded, sent_norm
        parts = self.flat.split([t.numel() for t in f.local])
        torch._foreach_copy_(f.local, [x.view_as(t) for x, t in zip(parts, f.local)])
        if excluded:
            r.restart_inner_if_nonfinite()
        fresh = PendingRound(
            round=r.round + 2,
            handle=handle,
            pseudo_grad_norm=local_norm,
            started=start,
            buffers=buffers,
            excluded=excluded,
            clipped=clipped,
            sent_norm=sent_norm,
        )
        r.add(fresh)
        done = replace(last or fresh, pseudo_grad_norm=local_norm, clipped=clipped, excluded=excluded, started=start)
        return r.advance(done, mean_norm=mean_norm, mean_clipped=mean_clipped)

    @torch.no_grad()
    def flush(self) -> None:
        """The last round's reduce settled and stepped into the consensus copy; the model and this worker's own
        params become it (the same on every worker)."""
        for pending in self.rounds.in_flight:
            self.rounds.apply(pending)
        self.fragment.load_global()
        self.reset()

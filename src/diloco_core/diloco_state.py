"""``DiLoCo.state_dict()`` and its loading: everything needed to continue bit-identically.

A checkpoint taken while reduces are in flight (overlap) first waits for them and keeps their means
(``in_flight``): the same on every worker, they are applied at the step they were due, so a resumed run
continues exactly as one that was not stopped. The model's floating-point buffers of such a round are
already averaged in it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from .eager import Eager
from .fragment import Fragment, Settled
from .report import PendingRound
from .rounds import Rounds
from .transport import ReduceResult

__all__ = ["in_flight_entry", "load_state", "restored", "state_of"]

_IN_FLIGHT = ("fragment", "finish_at", "round", "excluded", "clipped", "pseudo_grad_norm", "sent_norm")


def state_of(rounds: Rounds, fragments: Sequence[Fragment], eager: Eager | None) -> dict[str, Any]:
    """``rounds``' state (model, global copy, both optimizers, counters), the error-feedback residual
    (None without) and the contribution guard's references of ``fragments``, what the transport keeps
    about the run's state; with overlap, the settled means in flight and eager's own params."""
    for pending in rounds.in_flight:
        rounds.settle(pending)
    residuals = [f.feedback.residual for f in fragments]
    state = rounds.state_dict()
    if residuals[0] is None or len(fragments) == 1:
        state["residual"] = residuals[0]
    else:
        state["residual"] = torch.cat(residuals)
    guards = [f.guard.state_dict() for f in fragments]
    state["guard"] = guards[0] if len(fragments) == 1 else guards
    if eager is not None:
        state["eager"] = eager.state_dict()
    if rounds.in_flight:
        means = [fragments[p.fragment].reduce.flat for p in rounds.in_flight]
        state["in_flight"] = [in_flight_entry(p, mean=m) for p, m in zip(rounds.in_flight, means)]
    return state


def in_flight_entry(p: PendingRound, *, mean: torch.Tensor, settled: Settled | None = None) -> dict[str, Any]:
    """A reduce in flight whose mean is ``mean`` (settled: ``p.settled`` unless given), as checkpoints and
    ``RunState`` keep it: numbers, and the mean."""
    s = settled or p.settled
    assert s is not None
    kept = {k: getattr(p, k) for k in _IN_FLIGHT}
    tally = {"valid": s.valid, "contributors_norm": s.contributors_norm, "work": s.work}
    return {**kept, **asdict(s.result), **tally, "mean": mean}


_KEYS = [
    "model",
    "param_names",
    "model_state",
    "global",
    "outer_optimizer",
    "inner_optimizer",
    "inner_step",
    "round",
    "residual",
    "guard",
    "transport",
]


@torch.no_grad()
def load_state(rounds: Rounds, state: dict[str, Any], *, fragments: Sequence[Fragment], eager: Eager | None) -> None:
    """Load ``DiLoCo.state_dict()``'s dict: ``state_of``'s and the transport's, which ``DiLoCo`` loads after
    this (``ValueError`` naming what is missing or does not fit this run, before anything changes)."""
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValueError(f"DiLoCo state is missing {missing}: it was not written by DiLoCo.state_dict()")
    rounds.check_loadable(state)
    guards = state["guard"]
    saved_fragments = len(guards) if isinstance(guards, list) else 1
    if ("eager" in state) != (eager is not None) or len(fragments) != saved_fragments:
        raise ValueError("DiLoCo state was saved with other overlap settings (overlap, fragments) than this run's")
    residual = state["residual"]  # None: no error feedback
    sizes = [f.flat.numel() for f in fragments]
    parts = residual.split(sizes) if residual is not None else [None] * len(fragments)
    for i, f in enumerate(fragments):
        f.feedback.load(parts[i])
        f.guard.load_state_dict(guards[i] if isinstance(guards, list) else guards)
    if eager is not None:
        eager.load_state_dict(state["eager"])
    in_flight = [restored(fragments, p) for p in state.get("in_flight", [])]  # absent: none in flight
    rounds.load_state_dict(state, in_flight=in_flight)


def restored(fragments: Sequence[Fragment], saved: dict[str, Any], *, copy: bool = True) -> PendingRound:
    """The settled ``PendingRound`` of an ``in_flight_entry``, its mean put in place in its fragment's reduce
    buffer (unless not ``copy``)."""
    f = fragments[int(saved["fragment"])]
    if saved["mean"].shape != f.reduce.flat.shape:
        raise ValueError(f"DiLoCo state's mean in flight for fragment {saved['fragment']} does not fit this model")
    if copy:
        f.reduce.flat.copy_(saved["mean"])
    result = ReduceResult(
        int(saved["num_contributors"]), int(saved["bytes_sent"]), int(saved["bytes_received"]), float(saved["seconds"])
    )
    valid, norm = int(saved["valid"]), float(saved["contributors_norm"])
    settled = Settled(result=result, valid=valid, contributors_norm=norm, work=float(saved.get("work", valid)))
    kept = {k: saved[k] for k in _IN_FLIGHT}
    return PendingRound(handle=None, started=time.perf_counter(), settled=settled, **kept)

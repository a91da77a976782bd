"""``DiLoCo.state_dict()`` and its loading: everything needed to continue bit-identically.

A checkpoint taken while reduces are in flight (overlap) first waits for them and keeps their means
(``in_flight``): the same on every worker, they are applied at the step they were due, so a resumed run
continues exactly as one that was not stopped. The model's floating-point buffers of such a round are
already averaged in it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from .fragment import Settled
from .membership import Membership
from .report import PendingRound
from .transport import ReduceResult

if TYPE_CHECKING:
    from .diloco import DiLoCo

__all__ = ["in_flight_entry", "load_state", "restored", "state_of"]

_IN_FLIGHT = ("fragment", "finish_at", "round", "excluded", "clipped", "pseudo_grad_norm", "sent_norm")


def state_of(d: DiLoCo) -> dict[str, Any]:
    """Model (trainable parameters, their names, and by name its frozen parameters and persistent
    buffers), global copy, both optimizers, counters, the error-feedback residual (None without), the
    contribution guard's references, what the transport keeps about the run's state; with overlap, the
    settled means in flight and eager's own params."""
    for pending in list(d._pending):
        d._settle(pending)
    frags = d.fragments
    residuals = [f.feedback.residual for f in frags]
    state = {
        "model": [p.detach() for p in d.local],
        "param_names": list(d.model_state.names),
        "model_state": d.model_state.state_dict(),
        "global": d._global.flat,
        "outer_optimizer": d.outer_optimizer.state_dict(),
        "inner_optimizer": d.inner_optimizer.state_dict(),
        "inner_step": d.inner_step,
        "round": d.round,
        "residual": None if residuals[0] is None else torch.cat(residuals) if len(frags) > 1 else residuals[0],
        "guard": frags[0].guard.state_dict() if len(frags) == 1 else [f.guard.state_dict() for f in frags],
        "transport": d.transport.state_dict() if isinstance(d.transport, Membership) else {},
    }
    if d.eager is not None:
        state["eager"] = d.eager.state_dict()
    if d._pending:
        state["in_flight"] = [in_flight_entry(p, mean=d.fragments[p.fragment].reduce.flat) for p in d._pending]
    return state


def in_flight_entry(p: PendingRound, *, mean: torch.Tensor, settled: Settled | None = None) -> dict[str, Any]:
    """A reduce in flight whose mean is ``mean`` (settled: ``p.settled`` unless given), as checkpoints and
    ``RunState`` keep it: numbers, and the mean."""
    s = settled or p.settled
    assert s is not None
    r = s.result
    sums = {"num_contributors": r.num_contributors, "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received}
    return {
        **{k: getattr(p, k) for k in _IN_FLIGHT},
        **sums,
        "seconds": r.seconds,
        "valid": s.valid,
        "contributors_norm": s.contributors_norm,
        "mean": mean,
    }


@torch.no_grad()
def load_state(d: DiLoCo, state: dict[str, Any]) -> None:
    missing = {"model", "global", "outer_optimizer", "inner_optimizer", "inner_step", "round"} - set(state)
    if missing:
        raise ValueError(f"DiLoCo state is missing {sorted(missing)}")
    model, flat = state["model"], state["global"]
    shapes, here = [tuple(t.shape) for t in model], [tuple(t.shape) for t in d.local]
    if shapes != here or flat.shape != d._global.flat.shape:
        raise ValueError(
            f"DiLoCo state holds {len(shapes)} tensors ({flat.numel()} values); this model has "
            f"{len(here)} ({d._global.flat.numel()} values)"
        )
    d.model_state.check_loadable(state)  # absent names and model_state (older checkpoints) pass
    if ("eager" in state) != (d.eager is not None) or len(d.fragments) != _fragments_in(state):
        raise ValueError("DiLoCo state was saved with other overlap settings (overlap, fragments) than this run's")
    torch._foreach_copy_(d.local, list(model))
    d._global.flat.copy_(flat)
    d.model_state.load(state)
    d.outer_optimizer.load_state_dict(state["outer_optimizer"])
    d.inner_optimizer.load_state_dict(state["inner_optimizer"])
    d.inner_step = int(state["inner_step"])
    d.round = int(state["round"])
    residual = state.get("residual")  # absent (older checkpoints) or None: zero
    parts = residual.split([f.flat.numel() for f in d.fragments]) if residual is not None else [None] * len(d.fragments)
    guards = state.get("guard")  # absent (older checkpoints): no reference yet
    for i, f in enumerate(d.fragments):
        f.feedback.load(parts[i])
        f.guard.load_state_dict(guards[i] if isinstance(guards, list) else guards)
    if d.eager is not None:
        d.eager.load_state_dict(state["eager"])
    d._pending = [restored(d, p) for p in state.get("in_flight", [])]
    if "transport" in state and isinstance(d.transport, Membership):  # absent from older checkpoints
        d.transport.load_state_dict(state["transport"])


def _fragments_in(state: dict[str, Any]) -> int:
    guards = state.get("guard")
    return len(guards) if isinstance(guards, list) else 1


def restored(d: DiLoCo, saved: dict[str, Any], *, copy: bool = True) -> PendingRound:
    """The settled ``PendingRound`` of an ``in_flight_entry``, its mean put in place (unless not ``copy``)."""
    f = d.fragments[int(saved["fragment"])]
    if saved["mean"].shape != f.reduce.flat.shape:
        raise ValueError(f"DiLoCo state's mean in flight for fragment {saved['fragment']} does not fit this model")
    if copy:
        f.reduce.flat.copy_(saved["mean"])
    result = ReduceResult(
        int(saved["num_contributors"]), int(saved["bytes_sent"]), int(saved["bytes_received"]), float(saved["seconds"])
    )
    settled = Settled(result=result, valid=int(saved["valid"]), contributors_norm=float(saved["contributors_norm"]))
    kept = {k: saved[k] for k in _IN_FLIGHT}
    return PendingRound(handle=None, started=time.perf_counter(), settled=settled, **kept)

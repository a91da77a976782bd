"""A run's outer state as a transport whose peers come and go serves it to joiners and loads it.

The transport never reads DiLoCo: it gets a ``RunState`` at ``Transport.attach`` and treats what
``snapshot`` returns as opaque (a msgpack-able dict and tensors) to be handed to another peer's
``loader``. The global params are not in it: they travel by the broadcast ``DiLoCo`` makes when it
is built (a joiner downloads them there), and loading a state makes the model those global params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .guard import ContributionGuard

if TYPE_CHECKING:
    from .diloco import DiLoCo

__all__ = ["RunState"]


class RunState:
    """The outer momentum, round and guard references of one ``DiLoCo``, for peers that join or fall behind."""

    def __init__(self, diloco: DiLoCo) -> None:
        self._diloco = diloco
        self._listeners: list[Callable[[], None]] = []

    @property
    def key(self) -> str:
        """The key of the reduces whose results advance this state (DiLoCo's rounds)."""
        return self._diloco.reduce_key

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every outer round, once the new state is in place."""
        self._listeners.append(listener)

    def advanced(self) -> None:
        """Called by ``DiLoCo`` after each outer round."""
        for listener in self._listeners:
            listener()

    def snapshot(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(round, number of momentum buffers and the guard's references; the buffers cloned): safe to keep
        while training goes on."""
        d = self._diloco
        state = d.outer_optimizer.state_dict()["state"].values()
        buffers = [s["momentum_buffer"] for s in state if s.get("momentum_buffer") is not None]
        meta = {"round": d.round, "num_momentum": len(buffers), "guard": d.guard.state_dict()}
        return meta, [b.detach().clone() for b in buffers]

    def loader(self, meta: Any, tensors: list[torch.Tensor]) -> Callable[[], None]:
        """Check a peer's ``snapshot()`` against this DiLoCo (``ValueError`` if it does not fit, changing
        nothing) and return the function that loads it. Loading sets round and momentum, and the model
        to the global params, which must hold the peer's by then (its broadcast values)."""
        d = self._diloco
        n = meta.get("num_momentum") if isinstance(meta, dict) else None
        rnd = meta.get("round") if isinstance(meta, dict) else None
        if not isinstance(n, int) or not isinstance(rnd, int) or rnd < 0 or len(tensors) != n:
            raise ValueError(f"a peer's DiLoCo state does not fit: {meta!r} with {len(tensors)} tensor(s)")
        keys = list(d.outer_optimizer.state_dict()["param_groups"][0]["params"])
        if n not in (0, len(keys)):
            raise ValueError(f"a peer's DiLoCo state holds {n} momentum buffers for {len(keys)} outer parameter(s)")
        like = d._global.flat
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != like.shape:
                raise ValueError(f"a peer's outer momentum must be {tuple(like.shape)} x float32")
            if not bool(torch.isfinite(t).all()):
                raise ValueError("a peer's outer momentum holds NaN or infinite values")

        guard = ContributionGuard(d.codec, norm_clip=d.config.norm_clip, numel=d.guard.numel)
        guard.load_state_dict(meta.get("guard"))  # checks it (absent from older peers: no reference yet)

        def load() -> None:  # never calls back into the transport, which may hold its own locks
            with torch.no_grad():
                d._global.copy_to(d.local)  # after a round the model is the global copy
            outer = d.outer_optimizer.state_dict()
            outer["state"] = {k: {"momentum_buffer": t.clone()} for k, t in zip(keys, tensors)}  # none before round 1
            d.outer_optimizer.load_state_dict(outer)
            d.round = rnd
            d.guard.load_state_dict(guard.state_dict())
            d.inner_step = rnd * d.config.inner_steps

        return load

"""A run's outer state as a transport whose peers come and go serves it to joiners and loads it.

The transport never reads DiLoCo: it gets a ``RunState`` at ``Membership.attach`` and treats what
``snapshot`` returns as opaque (a msgpack-able dict and tensors) to be handed to another peer's
``loader``. The global params are not in it: they travel by the broadcast ``DiLoCo`` makes when it
is built (a joiner downloads them there), and loading a state makes the model those global params.

With overlap the state also holds the means of the reduces in flight that have completed (not yet
applied: they are due at a later step) and the inner step it was taken at, so that a peer that loads it
applies the same means at the same steps as the peers it came from (docs/overlap.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .config import DiLoCoConfig
from .diloco_state import in_flight_entry, restored
from .eager import Eager
from .fragment import Fragment, Settled
from .guard import ContributionGuard
from .report import PendingRound
from .rounds import Rounds

__all__ = ["RunState"]


class RunState:
    """The outer momentum, round and guard references of one ``DiLoCo``'s ``rounds`` (with overlap: also the
    inner step and the completed means in flight), for peers that join or fall behind; ``config`` is that
    DiLoCo's, ``fragments`` its fragments, ``eager`` its eager state (None without)."""

    def __init__(
        self,
        rounds: Rounds,
        config: DiLoCoConfig,
        *,
        fragments: Sequence[Fragment],
        eager: Eager | None = None,
    ) -> None:
        self._rounds = rounds
        self._fragments = list(fragments)
        self._config = config
        self._eager = eager
        self.lock = threading.RLock()
        """Held by ``DiLoCo`` while it changes its outer state (a round's boundary, a load): a transport that
        snapshots from another thread holds it, so that no round is half applied meanwhile."""
        self._at: int | None = None  # inside the boundary of this inner step: its outer work not yet done

    @property
    def keys(self) -> frozenset[str]:
        """The keys of the reduces whose results advance this state (DiLoCo's rounds, one per fragment)."""
        return frozenset(f.key for f in self._fragments)

    @property
    def means_in_flight(self) -> bool:
        """True (overlap) if the state holds the completed means in flight: a reduce's completion changes it too,
        so serve a snapshot taken after each (under ``lock``)."""
        return self._config.overlap != "none"

    @contextmanager
    def boundary(self, step: int) -> Iterator[None]:
        """``DiLoCo.step``'s outer work after inner step ``step``, under the lock: a snapshot taken inside it
        (as a reduce starts) is of the state before it, ``step - 1`` steps done, so that a peer loading it
        runs that boundary itself and begins the same reduce as the peers it came from."""
        with self.lock:
            self._at = step
            try:
                yield
            finally:
                self._at = None

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every outer round, once the new state is in place."""
        self._rounds.subscribe(listener)

    def snapshot(self) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """(round, number of momentum buffers and the guard's references; with overlap the inner step, the guards
        and the completed reduces in flight; the tensors cloned): safe to keep while training goes on. None
        (overlap) while a reduce in flight has not completed: a peer loading the state then would miss its
        mean; serve the last one instead (taken as that reduce started)."""
        r = self._rounds
        with self.lock:
            tensors = r.momentum()
            guard = self._fragments[0].guard.state_dict()
            meta: dict[str, Any] = {"round": r.round, "num_momentum": len(tensors), "guard": guard}
            meta["ended_at"] = r.ended_at
            if self.means_in_flight:
                flights = [self._completed(p) for p in r.in_flight]
                if None in flights:
                    return None
                meta["inner_step"] = r.inner_step if self._at is None else self._at - 1
                meta["guards"] = [f.guard.state_dict() for f in self._fragments]
                meta["in_flight"] = [{k: v for k, v in e.items() if k != "mean"} for e in flights]
                tensors += [e["mean"] for e in flights]
        return meta, tensors

    def _completed(self, p: PendingRound) -> dict[str, Any] | None:
        """A reduce in flight as ``in_flight_entry`` (its mean cloned), if it has completed; else None."""
        f = self._fragments[p.fragment]
        if p.settled is not None:
            return in_flight_entry(p, mean=f.reduce.flat.detach().clone())
        if (result := p.handle.completed() if p.handle is not None else None) is None:
            return None
        mean = f.reduce.flat.detach().clone()  # what the fragment's settle will make of it, on a copy
        tally = f.guard.settle(mean, result.num_contributors)
        settled = Settled(result=result, valid=tally.valid, contributors_norm=tally.norm, work=tally.work)
        return in_flight_entry(p, mean=mean, settled=settled)

    def loader(self, meta: Any, tensors: list[torch.Tensor]) -> Callable[[], None]:
        """Check a peer's ``snapshot()`` against this DiLoCo (``ValueError`` if it does not fit, changing
        nothing) and return the function that loads it. Loading sets round and momentum, and the model
        to the global params, which must hold the peer's by then (its broadcast values)."""
        r, frags = self._rounds, self._fragments
        n = meta.get("num_momentum") if isinstance(meta, dict) else None
        rnd = meta.get("round") if isinstance(meta, dict) else None
        flights = meta.get("in_flight", []) if isinstance(meta, dict) else None
        if (
            not isinstance(n, int)
            or not isinstance(rnd, int)
            or rnd < 0
            or not isinstance(flights, list)
            or (len(tensors) != n + len(flights))
        ):
            raise ValueError(f"a peer's DiLoCo state does not fit: {meta!r} with {len(tensors)} tensor(s)")
        if ("inner_step" in meta) != self.means_in_flight:
            raise ValueError("a peer's DiLoCo state was made with other overlap settings than this peer's")
        if n > len(frags):  # one outer parameter per fragment (streaming: none yet for those not synced)
            raise ValueError(f"a peer's DiLoCo state holds {n} momentum buffers for {len(frags)} outer parameter(s)")
        for t, f in zip(tensors[:n], frags):
            _check(t, f.param, "outer momentum")
        pending = [_pending(entry, mean, frags) for entry, mean in zip(flights, tensors[n:])]
        step = meta.get("inner_step", rnd * self._config.inner_steps)  # without overlap: the round's last step
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"a peer's DiLoCo state holds inner_step={step!r}: expected an integer >= 0")
        refs = meta.get("guards", [meta.get("guard")] * len(frags))
        guards = [ContributionGuard(f.codec, norm_clip=f.guard.norm_clip, numel=f.guard.numel) for f in frags]
        if not isinstance(refs, list) or len(refs) != len(guards):
            raise ValueError(f"a peer's DiLoCo state holds {refs!r} as guards for {len(guards)} fragment(s)")
        for g, ref in zip(guards, refs):
            g.load_state_dict(ref)  # checks it
        ended, bound = meta.get("ended_at"), self._config.round_seconds or 0.0  # wall clocks: skew within a round
        age = min(bound, max(0.0, time.time() - ended)) if isinstance(ended, float) and math.isfinite(ended) else 0.0

        def load() -> None:  # never calls back into the transport, which may hold its own locks
            with self.lock, torch.no_grad():
                r.to_model()  # after a round the model is the global copy
                r.load_momentum(tensors[:n])  # none before round 1
                for f, g in zip(frags, guards):
                    f.guard.load_state_dict(g.state_dict())
                for entry, _ in pending:
                    frags[entry["fragment"]].reduce.flat.copy_(entry["mean"])
                r.restore(round=rnd, inner_step=step, in_flight=[p for _, p in pending], began_ago=age)
                if self._eager is not None:  # its own params start as the consensus copy, nothing of its own in flight
                    self._eager.reset()

        return load


def _pending(entry: Any, mean: Any, frags: Sequence[Any]) -> tuple[dict[str, Any], Any]:
    """A peer's mean in flight, checked against this DiLoCo's fragments: (its entry with the mean, restored)."""
    frag = entry.get("fragment") if isinstance(entry, dict) else None
    if not isinstance(frag, int) or not 0 <= frag < len(frags):
        raise ValueError(f"a peer's DiLoCo state holds a mean in flight of no fragment here: {entry!r}")
    _check(mean, frags[frag].reduce.flat, "mean in flight")
    try:
        return {**entry, "mean": mean}, restored(frags, {**entry, "mean": mean}, copy=False)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"a peer's DiLoCo mean in flight does not fit: {e!r}") from None


def _check(t: Any, like: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != like.shape:
        raise ValueError(f"a peer's {what} must be {tuple(like.shape)} x float32")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"a peer's {what} holds NaN or infinite values")

"""A transport that forwards everything to another: the base of wrappers (fault injection, tracing).

A wrapper is as honest as what it wraps: over a ``Membership`` (hivemind) it is a ``Membership`` and
forwards those members too; over a fixed group it is not one, so ``isinstance(wrapper, Membership)``
answers as it would for the inner transport. ``ForwardingTransport(inner)`` picks the class (its
``__new__``), so every subclass gets this without writing it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from diloco_core import (
    FP32,
    MEAN,
    Capabilities,
    Codec,
    Membership,
    Merge,
    ReduceHandle,
    RunState,
    Transport,
)

__all__ = ["ForwardingTransport"]


class ForwardingTransport(Transport):
    """Forwards every member of ``Transport`` to ``inner`` (and of ``Membership``, where ``inner`` is one); a
    subclass overrides what it changes."""

    inner: Transport

    def __new__(  # noqa: PYI034
        cls, inner: Transport | None = None, *args: Any, **kwargs: Any
    ) -> ForwardingTransport:
        honest = (
            _with_membership(cls)
            if isinstance(inner, Membership) and not issubclass(cls, Membership)
            else cls
        )
        return super().__new__(honest)

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self.inner.capabilities

    @property
    def own_timeout(self) -> float | None:  # type: ignore[override]
        return self.inner.own_timeout

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        codec: Codec = FP32,
        key: str = "default",
        merge: Merge = MEAN,
    ) -> ReduceHandle:
        return self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge)

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        self.inner.broadcast(tensors, src=src, timeout=timeout)

    def close(self) -> None:
        self.inner.close()


class _ForwardingMembership(Membership):
    """The ``Membership`` members of a ``ForwardingTransport`` whose ``inner`` is a ``Membership``."""

    inner: Any

    @property
    def join_addresses(self) -> Sequence[str]:  # type: ignore[override]
        return self.inner.join_addresses

    def attach(self, state: RunState, timeout: float) -> bool:
        return self.inner.attach(state, timeout)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


@functools.cache
def _with_membership(cls: type[ForwardingTransport]) -> type[ForwardingTransport]:
    """``cls`` that is also a ``Membership`` forwarding to ``inner`` (one class per wrapper class)."""
    return type(
        cls.__name__,
        (cls, _ForwardingMembership),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )

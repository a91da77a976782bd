"""A transport that forwards everything to another: the base of wrappers (fault injection, tracing)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .codecs.base import FP32, Codec
from .run_state import RunState
from .transport import Capabilities, ReduceHandle, Transport

__all__ = ["ForwardingTransport"]


class ForwardingTransport(Transport):
    """Forwards every member of ``Transport`` to ``inner``; a subclass overrides what it changes."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self.inner.capabilities

    @property
    def own_timeout(self) -> float | None:  # type: ignore[override]
        return self.inner.own_timeout

    @property
    def join_addresses(self) -> Sequence[str]:  # type: ignore[override]
        return self.inner.join_addresses

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def attach(self, state: RunState, timeout: float) -> bool:
        return self.inner.attach(state, timeout)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, codec: Codec = FP32, key: str = "default") -> ReduceHandle:
        return self.inner.all_reduce(tensors, codec=codec, key=key)

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        self.inner.broadcast(tensors, src=src, timeout=timeout)

    def close(self) -> None:
        self.inner.close()

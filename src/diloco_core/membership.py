"""The second, smaller contract: what a transport whose peers come and go adds to ``Transport``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run_state import RunState

__all__ = ["Membership"]


class Membership(ABC):
    """Serving the run's state to joiners, and being joined by address (hivemind).

    A transport implements it besides ``Transport`` where members come and go during a run: a joiner loads
    the run's outer state from its peers and every member serves its own to later joiners. ``DiLoCo``
    checks for it with ``isinstance``; a transport with a fixed group (in-process, torch.distributed) does
    not implement it, and the core then neither attaches its state nor saves any for the transport. A
    ``ForwardingTransport`` over a ``Membership`` is a ``Membership`` too (it forwards these members).
    """

    join_addresses: Sequence[str] = ()
    """Where other peers reach this one to join the run (hivemind: its multiaddrs), for a launcher to show."""

    @abstractmethod
    def attach(self, state: RunState, timeout: float) -> bool:
        """Called once by ``DiLoCo``, when its global params are in place: load the run's outer state from the
        peers (``state.loader``), serve this worker's to later joiners (``state.snapshot``, refreshed through
        ``state.subscribe``), and return True if one was loaded."""

    @abstractmethod
    def state_dict(self) -> dict:
        """What the transport keeps about the run's state (hivemind: its state tag), saved within
        ``DiLoCo.state_dict()`` and handed back to ``load_state_dict`` on resume."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Called by ``DiLoCo.load_state_dict`` after DiLoCo's own state is in place."""

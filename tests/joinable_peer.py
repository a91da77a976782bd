"""``JoinablePeer``: what ``diloco_train.runs.join.print_join`` reads of a hivemind transport, and nothing else."""

from __future__ import annotations

from diloco_core import Membership


class JoinablePeer(Membership):
    """A peer's join addresses and, where it generated one, its secret (``join_settings``)."""

    def __init__(self, address: str, *, generated: str | None = None) -> None:
        self.join_addresses = [address]
        self.join_settings = {} if generated is None else {"secret": generated}

    def attach(self, state, timeout):
        raise NotImplementedError

    def state_dict(self):
        raise NotImplementedError

    def load_state_dict(self, state):
        raise NotImplementedError

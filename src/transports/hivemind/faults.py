"""Faults for tests to inject into a ``HivemindTransport`` (through its constructor, never module globals)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["HivemindFaults"]


@dataclass(frozen=True)
class HivemindFaults:
    """What to do wrong, and where. The faults run in the averager processes, which get them when they are
    forked (at the transport's construction and at an all-reduce of a new size). None: no fault."""

    reducer_received_part: Callable[[], None] | None = None
    """Called each time this peer, as a reducer, has received (and checked) a part of a groupmate's values."""
    reducer_sends_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Replaces what this peer, as a part's owner, sends back to a groupmate (it keeps the true one):
    the other contributors' payloads of the part, concatenated (``block_runner``: uint8 for a block
    codec, the wire dtype for a cast)."""
    relay_payloads: Callable[[list[torch.Tensor], torch.Tensor], list[torch.Tensor]] | None = None
    """As a part's owner (``block_runner``): given the payloads of the part it relays to a groupmate
    (the other contributors', group order) and its own, returns the payloads it relays instead (an
    insider's substitution: ``lambda others, own: [own] * len(others)``). What it states it received
    (``relay_check``) stays true."""
    exchange_fails: Callable[[], bool] | None = None
    """Asked as each exchange of a part begins; True: this peer's part exchange fails (always, while
    it says so): it sends its parts to no reducer (``AllreduceException`` at once), and as a reducer
    it answers every groupmate's parts with an error (``block_runner.BlockRunner``)."""
    distrusts: Callable[[str], bool] | None = None
    """Asked of each groupmate (its peer id, as ``str``) as a group forms; True: this peer treats it
    as benched, a verdict of its own its groupmates need not share (as ``strikes`` after rounds the
    others did not see)."""

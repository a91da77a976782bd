"""One attempt of a reduce: matchmaking and the group all-reduce (``attempt``, phases 1-4), the errors worth
another attempt (``RETRYABLE``), and phase 5: the result into the caller's tensors (``commit``; the group's
mean, or alone this peer's own values as they travel), with the state tag advanced."""

import concurrent.futures
import time
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from diloco_core import Codec, LeftOut
from diloco_core.transport import ReduceResult, TransportError

from .averager import Averager
from .deadlines import deadlines
from .grace import MIN_WINDOW, Window
from .handle import Outcome
from .reduce_number import Number
from .resources import Resources
from .tracked_state import TrackedState

# What a group attempt raises when peers or the network fail: worth another attempt.
RETRYABLE = (
    AllreduceException,
    MatchmakingException,
    P2PDaemonError,
    P2PHandlerError,
    TimeoutError,
    concurrent.futures.CancelledError,
)


def attempt(
    averager: Averager,
    tensors: list[torch.Tensor],
    *,
    gather: Any,
    number: Number | None,
    target: int | None,
    window: Window | None,
    resources: Resources,
) -> dict[str, Any]:
    """One matchmaking and group all-reduce of ``tensors`` that waits for ``target`` peers (with a grace
    ``window``: for at most that long, ``grace.py``), sending ``gather`` (the state tag, for rounds) and ``number``
    (the call's, for untracked keys: ``reduce_number``): the group's
    result, not yet in ``tensors``. Matchmaking starts first and the contribution is copied in while it runs (a
    group that forms sooner waits for the trigger). Bounded even if the averager's process dies mid-step."""
    limits = deadlines(resources.config)
    # With a window, a follower waits for its leader's window (which ends first) and the leader's word.
    timeout = (
        limits.matchmaking if window is None else window.seconds + max(MIN_WINDOW, window.seconds)
    )
    control = averager.step(
        gather=gather,
        number=number,
        timeout=timeout,
        allow_retries=False,
        wait=False,
        require_trigger=True,
        target_group_size=target,
        window=window,
    )
    try:
        fill(averager, tensors)
        control.allow_allreduce()
        return resources.wait(control, limits.attempt)
    except BaseException:
        if not control.done():
            control.cancel()
        raise


def fill(averager: Averager, tensors: list[torch.Tensor]) -> None:
    """The caller's values into the averager's buffer (casts: rounded to the wire dtype on the way in)."""
    with averager.get_tensors() as (buf,):
        # plain copies: foreach_copy_ is 5x slower
        for v, t in zip(buf.split([t.numel() for t in tensors]), tensors):
            v.copy_(t.detach().reshape(-1))


def commit(
    averager: Averager,
    tensors: list[torch.Tensor],
    *,
    out: dict[str, Any] | None,
    codec: Codec,
    tracked: bool,
    outcome: Outcome,
    start: float,
    state: TrackedState,
    me: bytes,
) -> tuple[ReduceResult, list[bytes]]:
    """Copy the group's result ``out`` (None: alone) into ``tensors``; the result and the group's peers.
    Called under the transport's lock."""
    if out is None:  # nobody to average with: my own values, as OpenDiLoCo
        n = 1
        sent = 0
        received = 0
        group = []
        left_out = ()
    else:  # the payload bytes this peer really sent and received in the round (its runner counted)
        n = len(out["peers"])
        sent = out["sent"]
        received = out["received"]
        group = list(out["peers"])
        left_out = tuple(LeftOut(*entry) for entry in out["left_out"])
    # Alone, the buffer holds my own values as they travel, like every contributor's.
    with averager.get_tensors() as (buf,):
        if outcome.abandoned:  # the caller timed out and may be retrying with these tensors
            raise TransportError("hivemind all_reduce finished after its caller had given up")
        # a block codec's buffer holds fp32 values
        if out is None and codec.elementwise_dtype is None:
            codec.decode(codec.encode(buf), buf)
        for r, t in zip(buf.split([t.numel() for t in tensors]), tensors):
            t.copy_(r.view_as(t))
        if tracked:  # alone, my state leaves the group's: my own mark, never equal to theirs
            state.commit(out["digest"] if out is not None else b"alone:" + me)
        took = time.perf_counter() - start
        outcome.result = ReduceResult(
            num_contributors=n,
            bytes_sent=sent,
            bytes_received=received,
            seconds=took,
            left_out=left_out,
        )
    return outcome.result, group

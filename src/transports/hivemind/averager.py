"""``Averager``: hivemind's ``DecentralizedAverager`` with the state check and the confirmation of a round.

Phase 2 (state check): groupmates' state tags came with matchmaking; if they differ nobody sends anything.
Phase 3 runs ``block_runner.BlockRunner`` (every codec), its relays checked (``relay_check``). Phase 4
(confirm): every peer sends (ok, digest of its result) to every groupmate and commits only if all of
them reported ok with its own digest.

It overrides hivemind's private ``DecentralizedAverager._aggregate_with_group``,
``DecentralizedAverager._run_allreduce_inplace_``, ``DecentralizedAverager._shutdown`` and
``DecentralizedAverager._declare_for_download_periodically`` (to declare the peer's presence too: ``presence``), and uses
private attributes (``_p2p``, ``_allreduce_timeout``, ``_running_groups``, ``_outer_pipe``, ``_matchmaking``:
a step's own ``target_group_size``, wait, request timeout and smallest group; its ``_p2p``'s
``_client_listen_maddr``: the socket an orphaned averager removes): this is why pyproject.toml pins
hivemind to the versions tested (``>=1.1.10,<1.2``). Check these overrides against hivemind's before
widening the pin.
"""

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils import get_dht_time

from diloco_core import Codec, Merge
from diloco_core.merge import combined

from .admission import Admission
from .auth import RunKeys, unwrap_gather, wrap_gather
from .blame import ExchangeFailed
from .block_runner import BlockRunner
from .confirm import Confirmations
from .donors import Donors
from .faults import HivemindFaults
from .forked import start_child
from .grace import Window
from .presence import Presence
from .quiet_logs import quiet_hivemind_records
from .reduce_number import Number, OutOfStepError, step_verdict
from .relay_check import RelayChecks
from .state_tag import StaleStateError, stale_verdict, tag_or_none
from .strikes import BENCH_MATCHMAKINGS, Strikes

logger = logging.getLogger(__name__)

ABSTAIN_TIMEOUT = 5.0
"""Seconds a groupmate has to take this peer's word that it withholds from a group (``confirm``)."""


class Averager(Admission, Presence, Donors, Confirmations, RelayChecks, DecentralizedAverager):
    """One flat buffer; the round's result replaces it only after the group confirmed one digest."""

    state_fn: Callable[[], tuple[Any, list[torch.Tensor]]] | None = None
    niceness = 0
    """Added to this process's niceness as it starts (``HivemindConfig.background_niceness``)."""

    def __init__(
        self,
        *,
        codec: Codec,
        merge: Merge,
        faults: HivemindFaults,
        keys: RunKeys,
        presence_key: str | None = None,
        client: bool = False,
        **kwargs: Any,
    ) -> None:
        """``presence_key``: declare this peer alive in the DHT under that key (``swarm.Swarm``
        reads it). ``keys``: the run's (``auth``): joins, confirmations and state downloads are
        checked with them. ``client``: this peer cannot accept connections (``reachability``): it
        owns no parts (hivemind's bandwidth 0) and serves no state, so that no payload and no state
        ever crosses a relay (hivemind's p2pd relays 128 KiB per connection in most of its starts,
        ``docs/wan.md``); it still leads groups, confirms and checks relays (small messages)."""
        self.codec = codec
        self.merge = merge
        self.faults = faults
        self.presence_key = presence_key
        self.keys = keys
        self._presence: dict = {}
        self._confirms: OrderedDict[bytes, dict] = OrderedDict()
        self._abstained: dict[str, float] = {}
        self._relay_digests: OrderedDict[bytes, dict] = OrderedDict()
        self._groups: dict[bytes, dict] = {}  # per group id: its deadline, then its result's digest
        self.init_admission()
        # a full member all the same (served through its relay): not hivemind's client_mode
        kwargs["allow_state_sharing"] = (
            kwargs.get("allow_state_sharing") is not False and not client
        )
        super().__init__(client_mode=False, bandwidth=0.0 if client else None, **kwargs)
        bench = BENCH_MATCHMAKINGS * self.matchmaking_kwargs["min_matchmaking_time"]
        self.strikes = Strikes(seconds=bench)
        self.apart_seconds = 2 * self.matchmaking_kwargs["min_matchmaking_time"]

    @property
    def allow_state_sharing(self) -> bool:
        return DecentralizedAverager.allow_state_sharing.fget(self)

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        """Never for a client (``__init__``): a joiner would download the state through a relay."""
        DecentralizedAverager.allow_state_sharing.fset(self, value and self.bandwidth != 0)

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's: it closes us cleanly
        # A SIGKILLed trainer's presence is not refreshed by its orphan (orphan.py), which leaves no socket either.
        start_child(niceness=self.niceness, cleanup=self._remove_client_socket)
        logging.getLogger("hivemind.averaging.averager").addFilter(quiet_hivemind_records)
        # The process's torch work is per-part (512 KB): one thread runs it faster than a pool whose
        # threads wait for each other (the checks' wall time in a 25M-value round was about twice as long).
        torch.set_num_threads(1)
        super().run()

    def step(
        self,
        *args: Any,
        target_group_size: int | None = None,
        window: Window | None = None,
        number: Number | None = None,
        **kwargs: Any,
    ) -> Any:
        """hivemind's step, with this step's ``target_group_size`` (None: the averager's own), grace ``window``
        (None: ``min_matchmaking_time`` and ``min_group_size`` as configured; ``grace.py``) and reduce
        ``number`` (``reduce_number``; None: a tracked key's, compared by state tag instead)."""
        # handled before the step (one pipe)
        self._outer_pipe.send(("_set_step", [target_group_size, window], {}))
        # a leader admits only peers of the run
        token = self.keys.join_token(self.prefix, self.peer_id.to_bytes())
        arrived = get_dht_time()
        if window is not None:
            kwargs["scheduled_time"] = arrived + window.seconds
        gather = wrap_gather(token, kwargs.pop("gather", None), arrived=arrived, number=number)
        return super().step(*args, gather=gather, **kwargs)

    async def _set_step(self, target: int | None, window: Window | None) -> None:
        mm, own = self._matchmaking, self.matchmaking_kwargs
        size = own["target_group_size"] if target is None else target
        mm.target_group_size = mm.potential_leaders.target_group_size = size
        wait = own["min_matchmaking_time"] if window is None else window.seconds
        mm.min_matchmaking_time = mm.potential_leaders.min_matchmaking_time = wait
        # below the wait (hivemind's Matchmaking)
        mm.request_timeout = min(own["request_timeout"], wait / 3)
        mm.min_group_size = own["min_group_size"] if window is None else window.quorum

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], None]:
        fn = self.state_fn
        meta, tensors = fn() if fn is not None else ({"ready": False}, [])
        return meta, tensors, None

    def _remove_client_socket(self) -> None:
        """This process's p2p client socket (hivemind's private ``_client_listen_maddr``), once nothing serves it."""
        p2p = getattr(self, "_p2p", None)
        maddr = str(getattr(p2p, "_client_listen_maddr", ""))
        if maddr.startswith("/unix/"):
            with contextlib.suppress(OSError):
                os.remove(maddr.removeprefix("/unix"))

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's, less its bug: it calls ``finalize`` on a running group's future (a traceback mid-round)."""
        try:
            if not self.client_mode:
                await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
            for future in self._running_groups.values():
                if future.done() and not future.cancelled() and future.exception() is None:
                    future.result().finalize(cancel=True)
                else:
                    future.cancel()
        finally:  # hivemind leaves the replica's client socket in /tmp (one file per averager, never reused)
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()

    async def _aggregate_with_group(
        self, group_info: Any, min_vector_size: int, **kwargs: Any
    ) -> Any:
        gathered = [unwrap_gather(self.serializer, g) for g in group_info.gathered]
        # Every groupmate checks every member's token (its leader did already): all reach the same verdict.
        strangers = [
            p
            for p, g in zip(group_info.peer_ids, gathered)
            if not self.keys.join_ok(self.prefix, p.to_bytes(), g.token)
        ]
        if strangers:
            raise AllreduceException(
                f"{len(strangers)} groupmate(s) without a valid join token: nothing sent"
            )
        me = group_info.peer_ids.index(self.peer_id)
        out_of_step = step_verdict([g.number for g in gathered], me)
        if out_of_step is not None:  # two calls of the key: nobody sends anything (reduce_number)
            raise OutOfStepError(out_of_step)
        tags = [tag_or_none(g.data) for g in gathered]
        arrivals = [g.arrived for g in gathered]
        # the same on every member
        spread = None if None in arrivals else max(arrivals) - min(arrivals)
        benched = [
            i
            for i, p in enumerate(group_info.peer_ids)
            if p != self.peer_id and self._distrusts(str(p))
        ]
        peers = [p.to_bytes() for p in group_info.peer_ids]  # to name a groupmate not credible
        verdict = stale_verdict(tags, me, distrusted=benched, peers=peers)
        if verdict is not None:  # every groupmate reaches the same verdict: nobody sends anything
            stale = StaleStateError(verdict)  # its culprits: left out of matchmaking a while
            culprits = [str(p) for p in group_info.peer_ids if p.to_bytes() in stale.culprits]
            self.strikes.failed(culprits, reason=str(verdict))
            # a verdict of this peer's own (the others may not have benched them): say so
            if benched:
                await self.abstain(
                    group_info.peer_ids, group_info.group_id, timeout=ABSTAIN_TIMEOUT
                )
            raise stale
        # Per group (a cancelled step may still be confirming while the next one starts).
        group_id = group_info.group_id
        self._groups[group_id] = {
            "deadline": time.monotonic() + (self._allreduce_timeout or 60.0) - 0.5
        }
        try:
            await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            peers = [p.to_bytes() for p in group_info.peer_ids]
            done = self._groups[group_id]
            return {k: done[k] for k in ("digest", "sent", "received", "left_out")} | {
                "peers": peers,
                "spread": spread,
            }
        # hivemind wraps every failure: whom the group blames goes out typed
        except MatchmakingException as e:
            blamed = e.__context__
            if not isinstance(blamed, ExchangeFailed):
                raise
            guilty = [str(p) for p in group_info.peer_ids if p.to_bytes() in blamed.culprits]
            self.strikes.failed([p for p in guilty if p != str(self.peer_id)], reason=str(blamed))
            raise blamed from None
        finally:
            self._groups.pop(group_id, None)

    async def _run_allreduce_inplace_(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: Any,
        group_id: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        # Every codec: payloads gathered per part, each member merges them (block_runner): no mean
        # returned by a part's owner.
        runner = BlockRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            codec=self.codec,
            merge=self.merge,
            faults=self.faults,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        error = None
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                raise AllreduceException("auxiliary peers are not supported")
            async for _ in runner:  # the means land in `tensors` part by part (Runner._register)
                pass
            if runner.failures:
                error = "partial all-reduce: " + "; ".join(runner.failures[:3])
        except Exception as e:  # noqa: BLE001 - any failure fails the round on every groupmate (confirm)
            error = f"{type(e).__name__}: {e}"
        deadline = self._groups[group_id]["deadline"]
        if runner.checks:  # relayed payloads against their senders' digests (relay_check)
            error = await self._check_relays(runner, group_id, error=error, deadline=deadline)
        digest = b"" if error else runner.digest()
        await self._confirm(
            group_info.peer_ids,
            group_id,
            error=error,
            digest=digest,
            deadline=deadline,
            failed=runner.blamed,
            owners=runner.owners(),
        )
        left_out = [
            dataclasses.astuple(o) for o in combined(runner.left_out)
        ]  # plain values, to the transport
        if not error:
            self.strikes.round(
                [str(p) for p in group_info.peer_ids if p != self.peer_id], [o[0] for o in left_out]
            )
        self._groups[group_id].update(
            digest=digest, sent=runner.bytes_sent, received=runner.bytes_received
        )
        self._groups[group_id]["left_out"] = left_out

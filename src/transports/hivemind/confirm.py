"""Phase 4 of a round, the confirmation: every peer sends (ok, digest of its result), MACed with the run's key,
to every groupmate and commits only if all of them reported ok with its own digest (a lost peer, a partial
all-reduce or a groupmate holding other bits fails the attempt on every member).
A peer that failed sends, instead of a digest, its report of the groupmates it saw fail, and the
group's verdict on whom to blame (``blame``) comes out typed (``ExchangeFailed``).
A peer that withholds from a group on purpose (a stale verdict: a groupmate it benched, or one out of
step, ``averager``) tells every groupmate so at once (``abstain``): its groupmates may not have
reached its verdict (they did not bench that peer) and see it send nothing, but nobody is blamed for
a groupmate that abstained (an honest peer was benched for it before)."""

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from .auth import MAC_BYTES, RunKeys
from .blame import ExchangeFailed, culprits, read_report, report

__all__ = ["Confirmations"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Wait:
    """A confirmation's wait (``Confirmations._confirm``): for whom, and what came of it so far."""

    others: list[Any]
    """The groupmates (this peer left out): only their confirmations count."""
    waited: list[Any]
    """Those waited for where the round failed: the others less those seen failing (all of them where
    every one was seen failing: ``blame``)."""
    digest: bytes
    deadline: float
    error: str | None
    """Why the round fails (None: not known to)."""
    left: float
    """Seconds left (at first at least 0.1): each send's timeout, read as the send starts, by when
    the wait has updated it."""
    got: dict[Any, tuple[bool, bytes]] = field(default_factory=dict)
    """The groupmates' confirmations so far: (ok, digest)."""

    def settled(self) -> bool:
        """Whether the wait is over: every groupmate confirmed (where the round failed: every
        groupmate waited for). A confirmation not ok with this peer's digest fails the round."""
        bad = [p for p, (ok, d) in self.got.items() if not ok or d != self.digest]
        if self.error is None and bad:  # the reports of the others still count (blame.py)
            self.error = f"{len(bad)} groupmate(s) failed or hold a different result"
        if self.error is None:
            return all(p in self.got for p in self.others)
        return all(p in self.got for p in self.waited)


class Confirmations:
    """The confirmation handler and sender of ``averager.Averager`` (a mixin: hivemind serves an averager's
    ``rpc_*`` methods)."""

    keys: RunKeys
    _confirms: OrderedDict[bytes, dict]
    """Per group id: the confirmations received ({peer: (ok, digest)}) and an event set on each."""
    _abstained: dict[str, float]
    """Groupmates (peer ids, ``str``) that abstained from a group of this peer's: until when (monotonic)
    it keeps apart from them (``kept_apart``)."""
    apart_seconds: float = 0.0

    def kept_apart(self, peer: str) -> bool:
        """Whether ``peer`` abstained from a group of this peer's in the last ``apart_seconds``: they
        do not meet (it would abstain again), as a stale groupmate is retried without."""
        return self._abstained.get(peer, 0.0) > time.monotonic()

    async def rpc_confirm(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        buffer = request.tensor_part.buffer
        digest, tag = buffer[:-MAC_BYTES], buffer[-MAC_BYTES:]
        mac = self.keys.confirm_mac(
            request.group_id, context.remote_id.to_bytes(), request.code, digest
        )
        if len(buffer) < MAC_BYTES or not hmac.compare_digest(tag, mac):
            # not from a peer of the run
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        box = self._confirm_box(request.group_id)
        box["got"][context.remote_id] = (request.code == averaging_pb2.AVERAGED_PART, digest)
        if request.code == averaging_pb2.CANCELLED:
            box["abstained"].add(context.remote_id)
        box["event"].set()
        return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)

    def _confirm_box(self, group_id: bytes) -> dict:
        if group_id not in self._confirms:
            self._confirms[group_id] = {"got": {}, "abstained": set(), "event": asyncio.Event()}
            while len(self._confirms) > 16:  # a peer only ever needs its latest groups
                self._confirms.popitem(last=False)
        return self._confirms[group_id]

    async def abstain(self, peer_ids: Sequence[Any], group_id: bytes, *, timeout: float) -> None:
        """Tell every groupmate that this peer sends nothing in group ``group_id`` (see the module
        docstring); a groupmate that does not answer within ``timeout`` s is left to its deadline."""
        code, empty = averaging_pb2.CANCELLED, b""
        mac = self.keys.confirm_mac(group_id, self.peer_id.to_bytes(), code, empty)
        msg = averaging_pb2.AveragingData(
            code=code, group_id=group_id, tensor_part=runtime_pb2.Tensor(buffer=mac)
        )
        stubs = [
            self.get_stub(self._p2p, p, namespace=self.prefix)
            for p in peer_ids
            if p != self.peer_id
        ]
        sends = [asyncio.wait_for(stub.rpc_confirm(msg), timeout) for stub in stubs]
        await asyncio.gather(*sends, return_exceptions=True)

    async def _confirm(
        self,
        peer_ids: Sequence[Any],
        group_id: bytes,
        *,
        error: str | None,
        digest: bytes,
        deadline: float,
        failed: Collection[Any] = (),
        owners: Collection[int] | None = None,
    ) -> None:
        """Send every groupmate (ok, ``digest``) and wait for theirs until ``deadline`` (monotonic); raise
        ``AllreduceException`` unless every one of them reported ok with this very digest:
        ``ExchangeFailed`` where the group blames some of its members (``blame``). ``failed``: the
        groupmates this peer's runner saw fail (reported instead of the digest, where it failed);
        ``owners``: the members that own parts (``blame.culprits``)."""
        others = [p for p in peer_ids if p != self.peer_id]
        if error is not None:
            digest = report(peer_ids, failed)
        # one seen failing may never answer; but one that saw all fail waits for every report (blame.py)
        void = len(others) >= 2 and all(p in failed for p in others)
        waited = others if void else [p for p in others if p not in failed]
        msg = self._confirmation(group_id, error=error, digest=digest)
        left = max(0.1, deadline - time.monotonic())
        wait = _Wait(
            others=others,
            waited=waited,
            digest=digest,
            deadline=deadline,
            error=error,
            left=left,
        )
        sends = [asyncio.create_task(self._send_confirmation(p, msg, wait)) for p in others]
        box = self._confirm_box(group_id)
        try:
            await self._await_confirmations(box, wait)
        finally:
            delivered = await asyncio.gather(*sends, return_exceptions=True)
            abstained = self._keep_apart(box, peer_ids, others)
            self._confirms.pop(group_id, None)
        error = wait.error
        if error is None and not all(d is True for d in delivered):
            # A groupmate that did not get my confirmation will not commit; neither may I.
            error = (
                f"{sum(d is not True for d in delivered)} confirmation(s) could not be delivered"
            )
        if error is not None:
            self._not_committed(
                peer_ids,
                error=error,
                failed=failed,
                got=wait.got,
                abstained=abstained,
                owners=owners,
            )

    def _confirmation(
        self,
        group_id: bytes,
        *,
        error: str | None,
        digest: bytes,
    ) -> averaging_pb2.AveragingData:
        """This peer's confirmation in group ``group_id``: ok with ``digest`` unless ``error``."""
        code = averaging_pb2.AVERAGED_PART if error is None else averaging_pb2.INTERNAL_ERROR
        mac = self.keys.confirm_mac(group_id, self.peer_id.to_bytes(), code, digest)
        tensor = runtime_pb2.Tensor(buffer=digest + mac)
        return averaging_pb2.AveragingData(code=code, group_id=group_id, tensor_part=tensor)

    async def _send_confirmation(
        self,
        peer: Any,
        msg: averaging_pb2.AveragingData,
        wait: _Wait,
    ) -> bool:
        """Whether ``peer`` got ``msg`` within the seconds the wait has left as this send starts."""
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            await asyncio.wait_for(stub.rpc_confirm(msg), wait.left)
            return True
        except Exception as e:  # noqa: BLE001 - a lost peer: receivers see a missing confirmation
            logger.debug("confirm to %s failed: %r", peer, e)
            return False

    async def _await_confirmations(self, box: dict, wait: _Wait) -> None:
        """Wait until every groupmate confirmed (those not seen failing, where the round failed) or
        the deadline passed; ``wait.error`` says why the round fails, if it does."""
        while True:
            # only this group's members count
            wait.got = {p: v for p, v in box["got"].items() if p in wait.others}
            if wait.settled():
                return
            box["event"].clear()
            wait.left = wait.deadline - time.monotonic()
            if wait.left <= 0:
                silent = sum(p not in wait.got for p in wait.others)
                wait.error = wait.error or f"{silent} groupmate(s) never confirmed the result"
                return
            try:
                await asyncio.wait_for(box["event"].wait(), wait.left)
            except asyncio.TimeoutError:
                pass

    def _keep_apart(self, box: dict, peer_ids: Sequence[Any], others: list[Any]) -> set[int]:
        """The groupmates that abstained (group indices), kept apart for ``apart_seconds``."""
        abstained = {peer_ids.index(p) for p in box["abstained"] if p in others}
        for i in abstained:
            self._abstained[str(peer_ids[i])] = time.monotonic() + self.apart_seconds
        return abstained

    def _not_committed(
        self,
        peer_ids: Sequence[Any],
        *,
        error: str,
        failed: Collection[Any],
        got: dict[Any, tuple[bool, bytes]],
        abstained: set[int],
        owners: Collection[int] | None,
    ) -> NoReturn:
        """Raise the round's failure: ``ExchangeFailed`` naming whom the group's reports blame
        (``blame``; a groupmate that abstained is not at fault), else ``AllreduceException``."""
        me, size = peer_ids.index(self.peer_id), len(peer_ids)
        reports = {me: read_report(report(peer_ids, failed), size=size, sender=me)}
        for p, (ok, d) in got.items():  # a groupmate that confirmed blames nobody
            i = peer_ids.index(p)
            reports[i] = frozenset() if ok else read_report(d, size=size, sender=i)
        guilty = culprits(size, reports, owners) - abstained  # withheld on purpose: no fault
        if guilty:
            blamed = tuple(peer_ids[i].to_bytes() for i in sorted(guilty))
            raise ExchangeFailed(blamed, f"round not committed: {error}")
        raise AllreduceException(f"round not committed: {error}")

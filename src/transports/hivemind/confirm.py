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
from typing import Any

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from .auth import MAC_BYTES, RunKeys
from .blame import ExchangeFailed, culprits, read_report, report

__all__ = ["Confirmations"]

logger = logging.getLogger(__name__)


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
        mac = self.keys.confirm_mac(request.group_id, context.remote_id.to_bytes(), request.code, digest)
        if len(buffer) < MAC_BYTES or not hmac.compare_digest(tag, mac):
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)  # not from a peer of the run
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
        msg = averaging_pb2.AveragingData(code=code, group_id=group_id, tensor_part=runtime_pb2.Tensor(buffer=mac))
        stubs = [self.get_stub(self._p2p, p, namespace=self.prefix) for p in peer_ids if p != self.peer_id]
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
    ) -> None:
        """Send every groupmate (ok, ``digest``) and wait for theirs until ``deadline`` (monotonic); raise
        ``AllreduceException`` unless every one of them reported ok with this very digest:
        ``ExchangeFailed`` where the group blames some of its members (``blame``). ``failed``: the
        groupmates this peer's runner saw fail (reported instead of the digest, where it failed)."""
        others = [p for p in peer_ids if p != self.peer_id]
        if error is not None:
            digest = report(peer_ids, failed)
        waited = [p for p in others if p not in failed]  # one seen failing may never answer
        code = averaging_pb2.AVERAGED_PART if error is None else averaging_pb2.INTERNAL_ERROR
        mac = self.keys.confirm_mac(group_id, self.peer_id.to_bytes(), code, digest)
        msg = averaging_pb2.AveragingData(
            code=code, group_id=group_id, tensor_part=runtime_pb2.Tensor(buffer=digest + mac)
        )
        left = max(0.1, deadline - time.monotonic())

        async def send(peer: Any) -> bool:
            try:
                await asyncio.wait_for(self.get_stub(self._p2p, peer, namespace=self.prefix).rpc_confirm(msg), left)
                return True
            except Exception as e:  # noqa: BLE001 - a lost peer is seen by the receivers as a missing confirmation
                logger.debug("confirm to %s failed: %r", peer, e)
                return False

        sends = [asyncio.create_task(send(p)) for p in others]
        box = self._confirm_box(group_id)
        try:
            while True:
                got = {p: v for p, v in box["got"].items() if p in others}  # only this group's members count
                bad = [p for p, (ok, d) in got.items() if not ok or d != digest]
                if error is None and bad:  # the reports of the others still count (blame.py)
                    error = f"{len(bad)} groupmate(s) failed or hold a different result"
                if error is None and all(p in got for p in others):
                    break
                if error is not None and all(p in got for p in waited):
                    break
                box["event"].clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    silent = sum(p not in got for p in others)
                    error = error or f"{silent} groupmate(s) never confirmed the result"
                    break
                try:
                    await asyncio.wait_for(box["event"].wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            delivered = await asyncio.gather(*sends, return_exceptions=True)
            abstained = {peer_ids.index(p) for p in box["abstained"] if p in others}
            for i in abstained:
                self._abstained[str(peer_ids[i])] = time.monotonic() + self.apart_seconds
            self._confirms.pop(group_id, None)
        if error is None and not all(d is True for d in delivered):
            # A groupmate that did not get my confirmation will not commit; neither may I.
            error = f"{sum(d is not True for d in delivered)} confirmation(s) could not be delivered"
        if error is not None:
            me, size = peer_ids.index(self.peer_id), len(peer_ids)
            reports = {me: read_report(report(peer_ids, failed), size=size, sender=me)}
            for p, (ok, d) in got.items():  # a groupmate that confirmed blames nobody
                i = peer_ids.index(p)
                reports[i] = frozenset() if ok else read_report(d, size=size, sender=i)
            guilty = culprits(size, reports) - abstained  # withheld on purpose: no fault
            if guilty:
                blamed = tuple(peer_ids[i].to_bytes() for i in sorted(guilty))
                raise ExchangeFailed(blamed, f"round not committed: {error}")
            raise AllreduceException(f"round not committed: {error}")

"""Phase 4 of a round, the confirmation: every peer sends (ok, digest of its result), MACed with the run's key,
to every groupmate and commits only if all of them reported ok with its own digest (a lost peer, a partial
all-reduce or a groupmate holding other bits fails the attempt on every member)."""

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from .auth import MAC_BYTES, RunKeys

__all__ = ["Confirmations"]

logger = logging.getLogger(__name__)


class Confirmations:
    """The confirmation handler and sender of ``averager.Averager`` (a mixin: hivemind serves an averager's
    ``rpc_*`` methods)."""

    keys: RunKeys
    _confirms: OrderedDict[bytes, dict]
    """Per group id: the confirmations received ({peer: (ok, digest)}) and an event set on each."""

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
        box["event"].set()
        return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)

    def _confirm_box(self, group_id: bytes) -> dict:
        if group_id not in self._confirms:
            self._confirms[group_id] = {"got": {}, "event": asyncio.Event()}
            while len(self._confirms) > 16:  # a peer only ever needs its latest groups
                self._confirms.popitem(last=False)
        return self._confirms[group_id]

    async def _confirm(
        self, peer_ids: Sequence[Any], group_id: bytes, *, error: str | None, digest: bytes, deadline: float
    ) -> None:
        """Send every groupmate (ok, ``digest``) and wait for theirs until ``deadline`` (monotonic); raise
        ``AllreduceException`` unless every one of them reported ok with this very digest."""
        others = [p for p in peer_ids if p != self.peer_id]
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
            while error is None:
                got = {p: v for p, v in box["got"].items() if p in others}  # only this group's members count
                bad = [p for p, (ok, d) in got.items() if not ok or d != digest]
                if bad:
                    error = f"{len(bad)} groupmate(s) failed or hold a different result"
                elif all(p in got for p in others):
                    break
                else:
                    box["event"].clear()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        error = f"{sum(p not in got for p in others)} groupmate(s) never confirmed the result"
                        break
                    try:
                        await asyncio.wait_for(box["event"].wait(), left)
                    except asyncio.TimeoutError:
                        pass
        finally:
            delivered = await asyncio.gather(*sends, return_exceptions=True)
            self._confirms.pop(group_id, None)
        if error is None and not all(d is True for d in delivered):
            # A groupmate that did not get my confirmation will not commit; neither may I.
            error = f"{sum(d is not True for d in delivered)} confirmation(s) could not be delivered"
        if error is not None:
            raise AllreduceException(f"round not committed: {error}")

"""Who an averager lets in: join requests only from peers of the run (a valid join token) that it does
not distrust (benched by strikes, kept apart after abstaining, or a test's verdict), and its state only to
peers that declared their presence in the run. Refusals are counted in throttled log lines, since anyone
can send such requests."""

from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing's AsyncIterator in RPC signatures

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from .auth import unwrap_gather
from .throttle import Throttle

__all__ = ["Admission"]


class Admission:
    """Needs the averager's ``keys``, ``faults``, ``strikes``, ``kept_apart`` (``confirm``),
    ``_is_peer_of_the_run`` (``presence``) and hivemind's ``prefix``, ``serializer``; ``init_admission``
    is called by the averager's ``__init__``."""

    def init_admission(self) -> None:
        self._turned_away = Throttle("turned away join requests without a valid token")
        self._refused = Throttle(
            "refused the state to peers without a presence record of the run (yet)"
        )
        self._benched = Throttle(
            "turned away join requests of peers left out of matchmaking (strikes.py)"
        )

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's, for peers of the run only: a follower without a valid join token is turned away."""
        token = unwrap_gather(self.serializer, request.gather).token
        if not self.keys.join_ok(self.prefix, context.remote_id.to_bytes(), token):
            self._turned_away.tick(f"from {context.remote_id}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if self._distrusts(str(context.remote_id)):
            self._benched.tick(f"from {context.remote_id}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, for peers of the run only: the requester must have declared its presence (a record
        MACed with the run's key, under the peer id libp2p authenticated)."""
        if not await self._is_peer_of_the_run(context.remote_id):
            self._refused.tick(f"to {context.remote_id}")
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    def _distrusts(self, peer: str) -> bool:
        """Benched (``strikes``), kept apart after it abstained (``confirm``), or a test's verdict."""
        own = self.faults.distrusts
        return (
            self.strikes.benched(peer) or self.kept_apart(peer) or (own is not None and own(peer))
        )

"""The donors of the run's state, as a peer that takes one sees them: what each one serves
(``offers``: the metadata of its snapshot, its state tag, read before any state is taken) and the
whole state of one chosen donor (``load_from``). hivemind's own ``load_state_from_peers`` takes the
first state of the donor that declares the highest ``state_sharing_priority``, which each donor sets
itself: one insider declaring round 10^6 was always tried first, and its state always taken
(``donor_choice`` decides which donor to take it from now).

A mixin of ``averager.Averager`` (hivemind's ``DecentralizedAverager``): its coroutines run in the
averager's process, reached through hivemind's private ``_outer_pipe`` like hivemind's own download,
and read hivemind's private ``_p2p`` and ``_matchmaking`` (see ``averager``'s docstring: why
hivemind is pinned).

Cost of ``offers``: one request per donor, all at once; each donor streams its metadata with the
first part of its first tensor (at most ``serving.PART_BYTES``, 512 KiB) and the stream is closed
there. So a peer that compares n donors' tags before downloading one state pays n round trips (in
parallel) and at most n x 512 KiB more than the download itself. Each tensor is written into shared
memory as its parts arrive (``incoming.Incoming``)."""

import asyncio
import logging
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.timed_storage import ValueWithExpiration

from .incoming import Incoming
from .serving import Serving

logger = logging.getLogger(__name__)

__all__ = ["Donors"]


class Donors(Serving):
    """Needs hivemind's ``dht``, ``peer_id``, ``prefix``, ``serializer``, ``get_stub`` and the
    private ``_outer_pipe``, ``_p2p`` and ``_matchmaking``. The donor's side of the same download
    (``serving.Serving``: what this peer streams to one that takes its state) comes with it."""

    def offers(self, timeout: float) -> MPFuture:
        """A future of {donor's peer id (bytes): the metadata it serves (as received, unchecked)},
        every donor that declares it serves state, read at once (each within ``timeout`` seconds).
        """
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_offers", [], {"future": future, "timeout": timeout}))
        return future

    def load_from(self, peer: bytes, timeout: float) -> MPFuture:
        """A future of (metadata, tensors) as donor ``peer`` serves them (unchecked), None if it
        served none."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_load_from", [peer], {"future": future, "timeout": timeout}))
        return future

    async def _donors(self) -> list[PeerID]:
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        got = await self.dht.get(key, latest=True, return_future=True)
        value = got.value if got is not None and isinstance(got.value, dict) else {}
        return [
            PeerID(peer)
            for peer, info in value.items()
            if isinstance(peer, bytes)
            and isinstance(info, ValueWithExpiration)
            and isinstance(info.value, (int, float))  # None: it stopped sharing
            and peer != self.peer_id.to_bytes()
        ]

    async def _offers(self, future: MPFuture, timeout: float) -> None:
        try:
            donors = await asyncio.wait_for(self._donors(), timeout)
            metas = await asyncio.gather(*(self._peek(p, timeout) for p in donors))
            if not future.done():
                future.set_result({p.to_bytes(): m for p, m in zip(donors, metas) if m is not None})
        except Exception as e:  # noqa: BLE001 - no donor read: the caller tries again
            logger.debug("state offers not read: %r", e)
            if not future.done():
                future.set_result({})

    async def _peek(self, peer: PeerID, timeout: float) -> Any:
        """The metadata ``peer`` serves: its stream's first message, then the stream is closed."""
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            request = stub.rpc_download_state(averaging_pb2.DownloadRequest())
            stream = await asyncio.wait_for(request, timeout)
            try:
                async for message in aiter_with_timeout(stream, timeout=timeout):
                    return self.serializer.loads(message.metadata) if message.metadata else None
            finally:
                await stream.aclose()
        except Exception as e:  # noqa: BLE001 - a donor that does not answer offers nothing
            logger.debug("no offer from %s: %r", peer, e)
        return None

    async def _load_from(self, peer: bytes, future: MPFuture, timeout: float) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID(peer), namespace=self.prefix)
            request = stub.rpc_download_state(averaging_pb2.DownloadRequest())
            stream = await asyncio.wait_for(request, timeout)
            metadata = None
            tensors: list[torch.Tensor] = []
            incoming: Incoming | None = None
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                part = message.tensor_part
                if part.dtype or incoming is None:  # the start of a tensor
                    if incoming is not None:
                        tensors.append(incoming.done())
                    incoming = Incoming(part)
                else:
                    incoming.add(part)
            if incoming is not None:
                tensors.append(incoming.done())
            if not future.done():
                future.set_result(None if metadata is None else (metadata, tensors))
        except Exception as e:  # noqa: BLE001 - the caller tries another donor
            logger.debug("state not downloaded from %s: %r", PeerID(peer), e)
            if not future.done():
                future.set_result(None)

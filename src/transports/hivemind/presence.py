"""A peer's presence in the run's DHT: the record ``swarm.Swarm`` reads to know who is at a reduce, refreshed
while the averager lives; and the check that a requester of the state declared its presence (is of the run).

A mixin of ``averager.Averager`` (hivemind's ``DecentralizedAverager``): it runs in the averager's process and
overrides hivemind's private ``_declare_for_download_periodically`` and sends on its private ``_outer_pipe``
(see ``averager``'s docstring: why hivemind is pinned).
"""

import asyncio
import logging
from typing import Any

from hivemind.utils import MPFuture, get_dht_time

logger = logging.getLogger(__name__)

__all__ = ["Presence", "presence_period"]


def presence_period(matchmaking_time: float) -> float:
    """Seconds a presence record lives (the averager's ``declare_state_period``); refreshed every third of it."""
    return max(5.0, matchmaking_time)


class Presence:
    """Needs ``presence_key`` (None: no presence declared) and ``_presence`` (the value declared) set by the
    averager's ``__init__``, and hivemind's ``dht``, ``peer_id`` and ``declare_state_period``."""

    def declare_presence(self, value: dict, *, wait: float = 0.0) -> None:
        """Tell the swarm where this peer is (``swarm.Swarm``): stored now and refreshed until
        shutdown; ``wait``: at most that many seconds until the DHT has it (a peer about to run a
        round: others that read an older record would close that round without it)."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_presence", [value], {"future": future}))
        if wait <= 0:
            return
        try:
            stored = future.result(timeout=wait)
        except TimeoutError:
            stored = False
        if not stored:
            logger.info(
                "presence not stored within %.1f s: the others may miss this peer a round", wait
            )

    async def _set_presence(self, value: dict, future: MPFuture) -> None:
        self._presence = value
        stored = await self._store_presence()
        if not future.done():
            future.set_result(stored)

    async def _store_presence(self) -> bool:
        ttl = self.declare_state_period
        try:
            future = self.dht.store(
                self.presence_key,
                subkey=self.peer_id.to_bytes(),
                value=self._presence,
                expiration_time=get_dht_time() + ttl,
                return_future=True,
            )
            return bool(await asyncio.wait_for(future, ttl / 3))
        except Exception as e:  # noqa: BLE001 - retried at the next refresh
            logger.debug("presence not stored: %r", e)
            return False

    async def _declare_for_download_periodically(self) -> None:
        # started with the serving of state: in this process's loop
        if self.presence_key is not None:
            asyncio.create_task(self._refresh_presence())
        await super()._declare_for_download_periodically()

    async def _refresh_presence(self) -> None:
        # refreshed well before it expires: a peer is never missing from the list while alive
        while True:
            await self._store_presence()
            await asyncio.sleep(self.declare_state_period / 3)

    async def _is_peer_of_the_run(self, peer: Any) -> bool:
        if self.presence_key is None:
            return False
        try:
            got = await asyncio.wait_for(
                self.dht.get(self.presence_key, latest=True, return_future=True), 10.0
            )
        except Exception as e:  # noqa: BLE001 - unknown: refused, the requester retries
            logger.debug("presence not read: %r", e)
            return False
        entry = (
            got.value.get(peer.to_bytes())
            if got is not None and isinstance(got.value, dict)
            else None
        )
        return entry is not None and entry.expiration_time > get_dht_time()

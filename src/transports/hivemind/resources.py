"""The processes a peer runs (its DHT and averagers, each with hivemind's p2p daemon client) and its
reduce thread: started one fork at a time, closed once (``close``, or a finalizer when nobody did)."""

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.dht.crypto import DHTRecord
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue

from diloco_core import MEAN, Codec, Merge
from diloco_core.transport import TransportError

from .auth import RunKeys, averager_keys
from .averager import Averager
from .faults import HivemindFaults
from .forked import forking, start_child
from .hivemind_config import HivemindConfig
from .presence import presence_period
from .reachability import decide, relay_settings, relayed
from .socket_files import bound_by, daemon_sockets, remove_new_stale, remove_stale

logger = logging.getLogger(__name__)

RELAY_WAIT = 10.0
"""Seconds a client waits for its relayed address before it goes on without one."""


class DHT(hivemind.DHT):
    """hivemind's DHT, whose p2p daemon (p2pd, started by this process) runs in a process group of its own.

    A Ctrl+C in a terminal sends SIGINT to the whole foreground process group. The DHT and averager
    processes ignore it (the parent closes them), but p2pd shuts down on it: the averagers then failed to
    close through it (about 150 lines of tracebacks) and the DHT waited out its grace period. In its own
    group p2pd hears only the parent's close. Like every process of a peer, it is still in the peer's session.
    """

    niceness = 0
    """Added to this process's niceness as it starts (p2pd, its child, inherits it)."""

    def run(self) -> None:
        # p2pd's socket and this process's client socket (hivemind names them alike): left in /tmp by a daemon
        # that failed to start (dead initial_peers) or that was killed with its orphaned DHT.
        daemons: list[str] = []

        # p2pd may still be exiting: a start that failed
        def remove_sockets(
            wait: float = 2.0,
        ) -> None:
            for path in daemons:
                remove_stale(path, wait=wait)  # once p2pd is gone
                with contextlib.suppress(OSError):  # this process's own, and it is ending
                    os.remove(path.replace("/hivemind-p2pd-", "/hivemind-p2pclient-"))

        # a SIGKILLed trainer leaves no DHT or p2pd
        start_child(niceness=self.niceness, cleanup=remove_sockets)
        # patched in this (the DHT's) process only
        spawn = asyncio.subprocess.create_subprocess_exec

        async def spawn_in_own_group(*args: Any, **kwargs: Any) -> Any:
            daemons.extend(
                str(a).split("/unix", 1)[1] for a in args if str(a).startswith("-listen=/unix/")
            )
            return await spawn(*args, preexec_fn=os.setpgrp, **kwargs)

        asyncio.subprocess.create_subprocess_exec = spawn_in_own_group  # type: ignore[assignment]
        try:
            super().run()
        finally:
            remove_sockets()

    def add_validators(self, record_validators: Any) -> None:
        """hivemind's, then this node forgets what it holds under the keys they protect and that fails their
        check: a value taken in while its key was not yet the run's (another node's junk, stored or cached
        here) was never checked, and read back it would be stripped as if MACed and hang the lookup."""
        validators = list(record_validators)
        super().add_validators(validators)
        ids = [key_id for v in validators for key_id in getattr(v, "key_ids", ())]
        self.run_coroutine(functools.partial(DHT._forget_unchecked, ids=ids))

    @staticmethod
    async def _forget_unchecked(_dht: Any, node: Any, ids: list[bytes]) -> None:
        # Reads hivemind's DHTNode.protocol.storage / .cache (private): check them before widening the pin.
        protocol = node.protocol
        for key in ids:
            for store in (protocol.storage, protocol.cache):
                held = store.get(DHTID.from_bytes(key))
                if held is None:
                    continue
                if isinstance(held.value, DictionaryDHTValue):
                    items = [
                        (protocol.serializer.dumps(k), v, t) for k, (v, t) in held.value.items()
                    ]
                else:
                    items = [(DHTProtocol.IS_REGULAR_VALUE, held.value, held.expiration_time)]
                if not all(
                    protocol.record_validator.validate(DHTRecord(key, *item)) for item in items
                ):
                    del store[DHTID.from_bytes(key)]


def _wait_until_ready(process: Any, what: str, timeout: float = 60.0) -> None:
    try:
        process.wait_until_ready(timeout)
    except concurrent.futures.TimeoutError:
        raise TransportError(
            f"hivemind: the {what} process did not start within {timeout:g}s"
        ) from None


@dataclass
class Resources:
    """What ``close`` releases; kept apart from the transport so that a finalizer can hold it."""

    config: HivemindConfig
    faults: HivemindFaults
    part_size_bytes: int
    keys: RunKeys
    """The run's keys (``auth``): the run's DHT records are MACed with them, others' rejected."""
    probe: bool = False
    """A peer that leaves at once (``diloco doctor``): a DHT client, in nobody's routing table."""
    dht: Any = None
    client: bool = False
    """This peer cannot accept connections (set by ``start_dht``): its averagers own no parts."""
    averagers: list = field(default_factory=list)
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    p2pd_socket: str | None = None
    """The DHT's p2p daemon's socket file: removed by ``close`` where hivemind left it (``socket_files``)."""
    sockets: list[str] = field(default_factory=list)
    """The averagers' socket files, removed by ``close`` where a killed averager left them."""
    closed: bool = False

    def __post_init__(self) -> None:
        n = self.part_size_bytes
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"part_size_bytes={n!r} is invalid: expected an integer >= 1")

    def start_dht(self) -> None:
        cfg = self.config
        peers = cfg.initial_peers
        mode, why = decide(
            cfg.reachability, initial_peers=peers, announce_maddrs=cfg.announce_maddrs
        )
        self.client = mode == "client"
        before = daemon_sockets()
        with forking(walk=cfg.release_inherited):
            self.dht = DHT(
                initial_peers=list(cfg.initial_peers),
                start=False,
                host_maddrs=list(cfg.host_maddrs),
                announce_maddrs=list(cfg.announce_maddrs) or None,
                # nobody dials a client's DHT node (a dial before its relay slot backs it off)
                client_mode=self.client or self.probe,
                **relay_settings(
                    mode, initial_peers=peers, addresses=[*cfg.host_maddrs, *cfg.announce_maddrs]
                ),
                record_validators=[self.keys.record_validator([self.keys.presence_key])],
                authorizer=self.keys.dht_authorizer(),  # members only (dht_auth.py)
            )
            self.dht.niceness = cfg.background_niceness
            self.dht.start()
        try:
            _wait_until_ready(self.dht, "DHT")
        except Exception as e:  # hivemind's RuntimeError, or p2pd's P2PDaemonError: the same cause
            remove_new_stale(before)  # the failed daemon's, left in /tmp
            if "bootstrap" not in str(e):
                raise
            raise TransportError(
                f"hivemind: none of initial_peers={list(cfg.initial_peers)} answered as a peer of this run: are the "
                "addresses right, is a peer there still running, and do all peers use the same run_id and secret? "
                "(`diloco doctor` with the same options checks each address)"
            ) from None
        relays = self._await_relay() if self.client else []
        # a client's rounds are slower (through a relay): said where a run's warnings are
        logger.log(
            logging.WARNING if self.client else logging.INFO,
            "reachability: %s (%s)%s",
            mode,
            why,
            f"; others reach it at {relays[0]}" if relays else "",
        )
        # hivemind's (private) query of the daemon's address, as its replicate_p2p does
        maddr = self.dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr)
        self.p2pd_socket = maddr.value_for_protocol("unix") if "/unix/" in str(maddr) else None

    def _await_relay(self) -> list[str]:
        """A client's relayed addresses once its daemon has a relay slot ([] after ``RELAY_WAIT``)."""
        deadline = time.monotonic() + RELAY_WAIT
        while not (found := relayed(self.dht.get_visible_maddrs(latest=True))):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not found:
            logger.warning(
                "no relay of initial_peers=%s took this client within %.0f s: peers that cannot "
                "reach it leave it out",
                list(self.config.initial_peers),
                RELAY_WAIT,
            )
        return found

    def start_averager(
        self,
        size: int,
        codec: Codec,
        *,
        prefix: str,
        merge: Merge = MEAN,
        share: bool = False,
        presence_key: str | None = None,
    ) -> Averager:
        """An averager of ``size`` values travelling as ``codec`` and merged by ``merge`` (a process), serving
        state to joiners if ``share``.
        Its buffer holds the values in the wire dtype (casts) or in fp32 (block codecs: encoded per part)."""
        cfg = self.config
        # Its records are the run's from the start (merged into the DHT's validator: auth.RecordAuth.merge_with).
        self.dht.add_validators([self.keys.record_validator(averager_keys(prefix))])
        averager = Averager(
            averaged_tensors=[torch.zeros(size, dtype=codec.elementwise_dtype or torch.float32)],
            dht=self.dht,
            start=False,
            prefix=prefix,
            codec=codec,
            merge=merge,
            faults=self.faults,
            keys=self.keys,
            presence_key=presence_key,
            client=self.client,
            min_group_size=cfg.min_group_size,
            target_group_size=cfg.target_group_size,
            min_matchmaking_time=cfg.matchmaking_time,
            request_timeout=min(3.0, cfg.matchmaking_time / 3),
            allreduce_timeout=cfg.averaging_timeout,
            next_chunk_timeout=cfg.averaging_timeout / 4,
            part_size_bytes=self.part_size_bytes,
            allow_state_sharing=share,
            declare_state_period=presence_period(cfg.matchmaking_time),
        )
        # Started by hand: hivemind's run_in_background would make *this* process ignore Ctrl+C
        # (and fails outside the main thread); the child ignores SIGINT itself (Averager.run).
        averager.niceness = cfg.background_niceness
        with forking(walk=cfg.release_inherited):
            averager.start()
        self.averagers.append(averager)
        _wait_until_ready(averager, "averager")
        self.sockets += bound_by(averager.pid)  # its p2p client's: a killed averager leaves it
        return averager

    def wait(self, future: Any, timeout: float) -> Any:
        """``future.result(timeout)``, but given up within a second of ``close()``: the thread waiting here
        is joined by the interpreter at exit, and a Ctrl+C should not wait for a step's or download's
        timeout (nor forever, for a process that close() has shut down)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if self.closed:
                    raise TransportError("hivemind transport was closed") from None
                if time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        for averager in self.averagers:  # averagers first: they use the DHT's p2p daemon
            try:
                if averager.is_alive():
                    averager.shutdown()
            except Exception as e:  # noqa: BLE001 - keep closing the rest
                logger.warning("hivemind averager did not shut down cleanly: %r", e)
        if self.dht is not None:
            try:
                if self.dht.is_alive():
                    self.dht.shutdown()
                    self.dht.join(10)
            except Exception as e:  # noqa: BLE001 - a failed close is logged, never raised
                logger.warning("hivemind DHT did not shut down cleanly: %r", e)
        for path in [self.p2pd_socket, *self.sockets]:
            remove_stale(path)

"""Run a function on every rank of a small world: threads for in-process, spawned processes for gloo.

``run(fn, *args)`` calls ``fn(transport, *args)`` on each rank and returns the per-rank results, an
exception becoming a ``RankError`` in that rank's slot. A gloo world keeps its processes (and process
group) between runs, since starting them costs seconds; one that timed out or failed is restarted.
Every child process is killed on close.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from threads import in_threads

from transports import ForwardingTransport, InProcessGroup, InProcessTransport

KINDS = ["inprocess", "torch", "hivemind"]
GROUP_TIMEOUT_S = 60.0
"""A gloo world's process group timeout: what a collective nobody completes waits out."""
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
"""hivemind peers listen on 127.0.0.1 only, on a free port."""
# matchmaking_time is the slack a late peer has to find its group (a follower gives up 2 x matchmaking_time
# after it starts looking, its leader starts the group after 1 x): 1 s was too tight for a loaded 2-core CI
# machine. Where every peer of a round is known, target_group_size starts the group as soon as all are in.
FAST = {
    "host_maddrs": LOCAL,
    "matchmaking_time": 2.0,
    "averaging_timeout": 8.0,
    "release_inherited": False,
}
"""The hivemind settings of the tests' peers. Their forks skip the walk that gives back inherited
tensors (0.06-0.1 s a fork in a test process, hundreds of forks: tens of seconds of the test run);
test_hivemind.py's swarm and test_hivemind_forked.py keep it."""


@dataclass
class RankError:
    type: str
    message: str

    def __repr__(self) -> str:
        return f"RankError({self.type}: {self.message})"


class ThreadWorld:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.capabilities = InProcessTransport.capabilities

    def run(self, fn: Callable, *args: Any, timeout: float = 60) -> list:
        group = InProcessGroup(self.world_size)
        results: list = [RankError("Timeout", "rank did not finish")] * self.world_size

        def body(rank: int) -> None:
            transport = group.transport(rank)
            try:
                results[rank] = fn(transport, *args)
            except Exception as e:  # noqa: BLE001 - every rank's failure is its result, checked by the test
                results[rank] = RankError(type(e).__name__, str(e))
            finally:
                transport.close()

        in_threads(body, self.world_size, timeout=timeout, what="in-process ranks")
        return results

    def close(self) -> None:
        pass


def _child(rank: int, world_size: int, store: str, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: tests never leave 127.0.0.1
    import torch
    import torch.distributed as dist

    from transports import TorchDistTransport

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    transport = TorchDistTransport()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, fn(transport, *args)))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            results.put((rank, RankError(type(e).__name__, f"{e}\n{traceback.format_exc(limit=3)}")))
    dist.destroy_process_group()


class GlooWorld:
    """``world_size`` processes joined in a gloo group over 127.0.0.1, reused across runs."""

    def __init__(self, world_size: int, tmpdir: str) -> None:
        from transports import TorchDistTransport

        self.world_size = world_size
        self.capabilities = TorchDistTransport.capabilities
        self._tmpdir = tmpdir
        self._generation = 0
        self._procs: list[mp.Process] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._generation += 1
        store = os.path.join(self._tmpdir, f"store{self._generation}")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_child, args=(r, self.world_size, store, self._tasks[r], self._results), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = 60, fresh: bool = False) -> list:
        """``fresh``: run in a new group (for runs that break it on purpose, such as a dead rank)."""
        if fresh or not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        results: list = [RankError("Timeout", f"rank sent no result within {timeout}s")] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            try:
                rank, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if all(not self._procs[r].is_alive() for r in pending):
                    for r in pending:
                        results[r] = RankError("Exited", f"exit code {self._procs[r].exitcode}")
                    break
                continue
            results[rank] = value
            pending.discard(rank)
        if fresh or any(isinstance(r, RankError) for r in results):
            self.close()
        return results

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        self._procs = []


class _Indexed(ForwardingTransport):
    """A hivemind peer seen as member ``index`` of ``size``: the contract's functions pick their values by
    rank, and hivemind peers have no fixed ranks."""

    def __init__(self, inner: Any, index: int, size: int) -> None:
        super().__init__(inner)
        self._index, self._size = index, size

    @property
    def rank(self) -> int:
        return self._index

    @property
    def world_size(self) -> int:
        return self._size


class HivemindWorld:
    """``world_size`` hivemind peers of one run (each with its own DHT daemon and averager processes,
    talking over 127.0.0.1), driven from threads; peer 0 starts the swarm and the others join it. Peers
    are kept across runs; after a run that closed one (a crash), or one with other settings, the next run starts a
    fresh swarm."""

    def __init__(self, world_size: int) -> None:
        from transports.hivemind import HivemindTransport

        self.world_size = world_size
        self.capabilities = HivemindTransport.capabilities
        self._peers: list[Any] = []
        self._generation = 0
        self._settings: dict = {}

    def _start(self, settings: dict) -> None:
        from transports.hivemind import HivemindConfig, HivemindTransport

        self._generation += 1
        cfg = {
            "run_id": f"contract-{os.getpid()}-{self._generation}",
            "secret": "s",
            **FAST,
            **settings,
            "target_group_size": self.world_size,  # the full group starts at once
        }
        self._settings = settings
        self._peers = [HivemindTransport(HivemindConfig(**cfg))]
        for _ in range(self.world_size - 1):
            self._peers.append(HivemindTransport(HivemindConfig(**cfg, initial_peers=self._peers[0].join_addresses)))

    def run(
        self, fn: Callable, *args: Any, timeout: float = 60, fresh: bool = False, settings: dict | None = None
    ) -> list:
        """``settings``: ``HivemindConfig`` fields that replace FAST's for this run's peers."""
        settings = settings or {}
        if fresh or settings != self._settings or not self._peers or any(p._closed for p in self._peers):
            self.close()
            self._start(settings)
        results: list = [RankError("Timeout", "peer did not finish")] * self.world_size

        def body(i: int) -> None:
            try:
                results[i] = fn(_Indexed(self._peers[i], i, self.world_size), *args)
            except Exception as e:  # noqa: BLE001 - every peer's failure is its result, checked by the test
                results[i] = RankError(type(e).__name__, str(e))

        in_threads(body, self.world_size, timeout=timeout, what="hivemind peers")
        return results

    def close(self) -> None:
        for p in self._peers:
            p.close()
        self._peers = []


def make_world(kind: str, world_size: int, tmpdir: str) -> ThreadWorld | GlooWorld | HivemindWorld:
    if kind == "hivemind":
        return HivemindWorld(world_size)
    return ThreadWorld(world_size) if kind == "inprocess" else GlooWorld(world_size, tmpdir)

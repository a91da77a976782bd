"""What a hivemind peer leaves behind: no socket file, even after one of its averager processes was killed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
from world import FAST

pytestmark = pytest.mark.timeout(90)


def _stale_sockets() -> set[Path]:
    """hivemind's socket files in /tmp that no process has bound (/proc/net/unix lists the bound ones)."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    bound = {parts[7] for parts in map(str.split, lines) if len(parts) >= 8}
    return {p for p in Path("/tmp").glob("hivemind-*.sock") if str(p) not in bound}


@pytest.mark.skipif(not Path("/proc/net/unix").exists(), reason="needs Linux's /proc to tell bound sockets")
def test_a_killed_averager_leaves_no_socket_file():
    from transports.hivemind import HivemindConfig, HivemindTransport
    from transports.hivemind.averager import Averager

    before = _stale_sockets()
    peer = HivemindTransport(HivemindConfig(run_id=f"leftovers-{os.getpid()}", secret="x", **FAST))
    try:
        averagers = [p for p in mp.active_children() if isinstance(p, Averager)]
        assert averagers, "the peer runs its state averager as a process"
        for p in averagers:  # as the OOM killer would
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    finally:
        peer.close()
    assert _stale_sockets() - before == set()

"""A DiLoCo peer over hivemind as a process of its own (tests/hivemind_peer.py), driven line by line."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading

import procs

HERE = os.path.dirname(os.path.abspath(__file__))


class PeerProcess:
    def __init__(
        self,
        name: int,
        transport: dict,
        log: str,
        die_flag: str | None = None,
        diloco: dict | None = None,
        wrap: list[str] | None = None,
    ) -> None:
        """``wrap``: words before the command (e.g. ``netns.Network.wrap``: in a network namespace)."""
        args = json.dumps({"name": name, "transport": transport, "die_flag": die_flag, "diloco": diloco or {}})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.join(os.path.dirname(HERE), "src")])}
        with open(log, "a") as stderr:  # the peer holds its own copy of the file
            self.proc = subprocess.Popen(
                [*(wrap or []), sys.executable, os.path.join(HERE, "hivemind_peer.py"), args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                start_new_session=True,
            )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        try:  # stdout closes as the process dies, a moment before its exit status exists: wait for it
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        self.lines.put({"exited": code})

    def next(self, timeout: float = 60) -> dict:
        return self.lines.get(timeout=timeout)

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        procs.kill_session(self.proc)  # the peer, its DHT, its averagers and its p2pd (in a group of its own)


def exit_all(peers: list[PeerProcess]) -> bool:
    """Tell every peer to exit; True if each says it closed its transport."""
    for p in peers:
        p.send("exit")
    return all(p.next().get("closed") for p in peers)

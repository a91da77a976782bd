"""Processes the tests start and check: as /proc shows them (Linux; psutil is not required), for tests that
check what a peer or a launcher leaves behind; the torchrun command; killing a session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    pid: int
    name: str
    state: str
    """One letter; "Z" is a zombie (exited, not yet reaped)."""
    ppid: int
    session: int


def processes() -> list[Proc]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        out.append(
            Proc(int(entry), stat[stat.index("(") + 1 : stat.rindex(")")], fields[0], int(fields[1]), int(fields[3]))
        )
    return out


def alive(pid: int) -> bool:
    return any(p.pid == pid and p.state != "Z" for p in processes())


def children(pid: int) -> list[int]:
    return [p.pid for p in processes() if p.ppid == pid]


def descendants(pid: int) -> list[Proc]:
    procs = processes()
    found, frontier = [], {pid}
    while frontier:
        kids = [p for p in procs if p.ppid in frontier]
        found += kids
        frontier = {p.pid for p in kids}
    return found


def live_in_session(session: int) -> list[int]:
    return [p.pid for p in processes() if p.session == session and p.state != "Z"]


def pipe_of(fd: int) -> str | None:
    """``pipe:[inode]`` if this process's ``fd`` is a pipe end, else None."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    return target if target.startswith("pipe:") else None


def writers(pipe: str) -> set[int]:
    """pids of processes with the write end of ``pipe`` (as ``pipe_of`` names it) open."""
    out = set()
    for p in processes():
        try:
            fds = os.listdir(f"/proc/{p.pid}/fd")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p.pid}/fd/{fd}") != pipe:
                    continue
                with open(f"/proc/{p.pid}/fdinfo/{fd}") as f:
                    flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
            except (OSError, StopIteration):
                continue
            if flags & os.O_ACCMODE == os.O_WRONLY:
                out.add(p.pid)
                break
    return out


def stale_sockets(paths: set[str]) -> set[str]:
    """The socket files among ``paths`` that no live process listens on (left behind), whatever other
    processes on the machine (another test run's hivemind peers) create meanwhile."""
    with open("/proc/net/unix") as f:
        bound = {line.split()[-1] for line in f.readlines()[1:] if len(line.split()) >= 8}
    return {p for p in paths if os.path.exists(p) and p not in bound}


def left_in_session(session: int, *, within: float) -> list[int]:
    """The live processes of ``session`` once none is left or ``within`` seconds have passed (they exit on
    their own: a test that checks nothing is left behind gives them that long)."""
    deadline = time.monotonic() + within
    while (live := live_in_session(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return live


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every live process of the session ``proc`` leads (started with ``start_new_session=True``: a
    hivemind peer with its DHT, averagers and p2pd, or a launcher with its workers), and reap ``proc``."""
    for pid in live_in_session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(10)


def loopback_env(**extra: str) -> dict[str, str]:
    """This process's environment with gloo on the loopback interface: tests never leave 127.0.0.1."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **extra}


def torchrun(*args: str, nproc: int = 2, max_restarts: int | None = None) -> list[str]:
    """The command that runs ``args`` (a script and its arguments, or ``-m module ...``) as ``nproc`` ranks on
    this machine under torchrun (its standalone rendezvous)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts is not None:
        cmd.append(f"--max-restarts={max_restarts}")
    return [*cmd, *args]

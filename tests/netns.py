"""Networks of peers on one machine, for tests and benchmarks (root only): one network namespace per peer,
each joined by a veth pair to a bridge in a hub namespace of its own, each link shaped with ``tc tbf``.

    with Network(peers=4, rate="100mbit") as net:
        net.address(0)                  # "10.77.0.1": peer 0's address on the bridge
        net.popen(0, [sys.executable, ...])   # runs in peer 0's namespace

A peer that should be *unreachable* listens on its namespace's loopback only: it can connect out to the
others' bridge addresses, nobody can connect in, and two such peers cannot reach each other (as behind two
NATs). Latency: netem is absent on these machines, so ``delay_proxy.py`` (a TCP relay that holds every
byte for a set time) fronts a reachable peer's listener. Every namespace is named after this process
(``dl<pid>-...``) and deleted on exit, or by the next ``Network`` of any process once its owner is dead.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable

import procs

PREFIX = "dl"


def available() -> str | None:
    """Why networks cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove(ns: str) -> None:
    """SIGKILL every process in ``ns`` (whatever its session: a peer's p2pd has its own), then delete it."""
    out = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True, timeout=30)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)


def remove_orphans() -> list[str]:
    """Remove the namespaces of networks whose process is gone (a test run killed with SIGKILL or
    SIGTERM), and what runs in them; their names."""
    gone = []
    for ns in namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-[\w-]+", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            remove(ns)
            gone.append(ns)
    return gone


class Network:
    def __init__(self, *, peers: int, rate: str | None = None, private: Iterable[int] = ()) -> None:
        self.peers = peers
        self.private = frozenset(private)
        self.rate = rate
        self.tag = f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}"
        self.hub = f"{self.tag}-hub"
        self.made: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def name(self, k: int) -> str:
        return f"{self.tag}-p{k}"

    def address(self, k: int) -> str:
        """Peer ``k``'s address: in 10.77.0.0/24 (private, as behind NAT) for the ``private`` peers,
        else in 11.77.0.0/24 (public: libp2p relays only through a peer with a public address). No
        packet leaves the hub's bridge."""
        return f"{10 if k in self.private else 11}.77.0.{k + 1}"

    def __enter__(self) -> Network:  # noqa: PYI034 - a final class
        remove_orphans()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        self.made.append(self.hub)
        self.run_in(self.hub, "ip", "link", "add", "br0", "type", "bridge")
        self.run_in(self.hub, "ip", "link", "set", "br0", "up")
        for k in range(self.peers):
            ns = self.name(k)
            _ip("netns", "add", ns)
            self.made.append(ns)
            # both ends made inside the peer's namespace, the hub's end then moved: names never collide
            self.run_in(ns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", f"h{k}")
            self.run_in(ns, "ip", "link", "set", f"h{k}", "netns", self.hub)
            self.run_in(ns, "ip", "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            for dev in ("lo", "eth0"):
                self.run_in(ns, "ip", "link", "set", dev, "up")
            # both subnets on the bridge's link; and a default route, as a host has (libp2p finds its
            # own address from it)
            mine = "10.77.0.0/24" if k in self.private else "11.77.0.0/24"
            other = "11.77.0.0/24" if k in self.private else "10.77.0.0/24"
            self.run_in(ns, "ip", "route", "add", other, "dev", "eth0")
            self.run_in(ns, "ip", "route", "add", "default", "via", mine.replace("0/24", "254"),
                        "dev", "eth0", "onlink")  # fmt: skip
            self.run_in(self.hub, "ip", "link", "set", f"h{k}", "master", "br0")
            self.run_in(self.hub, "ip", "link", "set", f"h{k}", "up")
            if self.rate:  # both directions of the peer's link: out of eth0, and out of the hub's end
                self._shape(ns, "eth0")
                self._shape(self.hub, f"h{k}")

    def _shape(self, ns: str, dev: str) -> None:
        self.run_in(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                    "burst", "256kb", "latency", "400ms")  # fmt: skip

    def run_in(self, ns: str, *argv: str) -> None:
        _ip("netns", "exec", ns, *argv)

    def popen(self, k: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` in peer ``k``'s namespace, in a session of its own (killed by ``close`` with its
        session if still running)."""
        proc = subprocess.Popen(self.wrap(k) + argv, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def wrap(self, k: int) -> list[str]:
        """The words that run a command in peer ``k``'s namespace."""
        return ["ip", "netns", "exec", self.name(k)]

    def close(self) -> None:
        for proc in self.procs:
            procs.kill_session(proc)
        for ns in reversed(self.made):
            remove(ns)
        self.made = []

    def __exit__(self, *exc: object) -> None:
        self.close()

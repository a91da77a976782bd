"""The test networks (``netns.py``) and the delaying relay (``delay_proxy.py``): what they claim to build is
there (the rate, the delay, who can reach whom), and nothing is left after them, a failure included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import netns
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())),
]

# In peer 1's namespace: connect to ADDR, send N bytes, wait for one byte back; print the seconds taken
# to connect and echo one byte, and to send the N bytes.
CLIENT = """
import socket, sys, time, json
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=10)
t = time.monotonic(); s.sendall(b"x"); s.recv(1); rtt = time.monotonic() - t
t = time.monotonic(); s.sendall(bytes(n)); s.shutdown(socket.SHUT_WR); s.recv(1)
print(json.dumps({"rtt": rtt, "seconds": time.monotonic() - t}))
"""

# In peer 0's namespace: accept one connection, echo its first byte, count the rest, then answer one byte.
SERVER = """
import socket, sys, json
srv = socket.socket(); srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen()
print(json.dumps({"ready": srv.getsockname()[1]}), flush=True)
c, _ = srv.accept(); c.sendall(c.recv(1))
while c.recv(1 << 16):
    pass
c.sendall(b"y")
"""


def _line(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def _client(net: netns.Network, host: str, port: int, n: int) -> dict:
    out = subprocess.run(
        [*net.wrap(1), sys.executable, "-c", CLIENT, host, str(port), str(n)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_shaped_link_with_a_delaying_relay_has_the_rate_and_delay_it_claims():
    with netns.Network(peers=2, rate="100mbit") as net:
        server = net.popen(0, [sys.executable, "-c", SERVER, "127.0.0.1", "0"], stdout=subprocess.PIPE, text=True)
        port = _line(server)["ready"]
        proxy = net.popen(
            0,
            [sys.executable, os.path.join(HERE, "delay_proxy.py"), "--listen", f"{net.address(0)}:0",
             "--to", f"127.0.0.1:{port}", "--delay", "0.05"],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        got = _client(net, net.address(0), _line(proxy)["ready"], 25_000_000)
    print(got)  # the figures, with -s
    # a round trip holds 50 ms each way
    assert 0.1 <= got["rtt"] < 0.2
    # 25 MB at 100 Mbit/s: 2.0 s on the wire, plus the relay's 100 ms
    assert 1.8 < got["seconds"] < 3.0


def test_a_peer_listening_on_its_loopback_cannot_be_reached_but_reaches_out():
    with netns.Network(peers=2) as net:
        server = net.popen(0, [sys.executable, "-c", SERVER, "127.0.0.1", "0"], stdout=subprocess.PIPE, text=True)
        port = _line(server)["ready"]
        with pytest.raises(AssertionError, match="refused"):
            _client(net, net.address(0), port, 1)  # from peer 1: nothing listens on peer 0's address
        server = net.popen(0, [sys.executable, "-c", SERVER, net.address(0), "0"], stdout=subprocess.PIPE, text=True)
        assert _client(net, net.address(0), _line(server)["ready"], 1)["rtt"] < 0.1
        names = [net.name(0), net.name(1), net.hub]
        assert set(names) <= set(netns.namespaces())
    assert not set(names) & set(netns.namespaces())  # and their processes were killed with them
    assert all(p.poll() is not None for p in net.procs)


def test_a_failure_inside_leaves_no_namespace_and_a_dead_owners_namespaces_are_removed():
    with pytest.raises(RuntimeError), netns.Network(peers=2) as net:
        sleeper = net.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("a test failed")
    assert sleeper.poll() is not None
    assert not [n for n in netns.namespaces() if n.startswith(net.tag)]
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = f"{netns.PREFIX}{dead.pid}-beef-p0"  # as a killed test run leaves one
    subprocess.run(["ip", "netns", "add", orphan], check=True, timeout=30)
    try:
        assert orphan in netns.remove_orphans()
    finally:
        subprocess.run(["ip", "netns", "del", orphan], check=False, capture_output=True, timeout=30)
    assert orphan not in netns.namespaces()

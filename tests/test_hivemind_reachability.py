"""Peers that cannot accept connections (``transport.reachability``): full members through a public peer's
relay. The swarm runs in network namespaces (``netns.py``): a private peer has an address in 10.77.0.0/24
and listens on its own loopback only, so nobody can connect to it, and two of them cannot reach each other."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import netns
import procs
import pytest
from peer_process import PeerProcess, exit_all

from transports.hivemind import HivemindConfig
from transports.hivemind.reachability import decide

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "reachability-test-secret-0123456789"
# settings of the swarm: small windows, so that a round that waits for someone it cannot reach shows
BASE = {"run_id": "nat", "secret": SECRET, "matchmaking_time": 3.0, "averaging_timeout": 10.0}


def test_auto_is_public_for_a_founder_an_announced_address_and_a_lan():
    assert decide("auto", initial_peers=(), announce_maddrs=())[0] == "public"
    lan = ["/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWExample"]
    assert decide("auto", initial_peers=lan, announce_maddrs=())[0] == "public"
    public = ["/ip4/203.0.113.9/tcp/4000"]
    assert decide("auto", initial_peers=lan, announce_maddrs=public)[0] == "public"
    assert decide("client", initial_peers=lan, announce_maddrs=()) == ("client", "as configured")


def test_a_bad_reachability_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"reachability='nat' is invalid: expected one of \['auto'"):
        HivemindConfig(reachability="nat")


needs_root = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def _decide_in(net: netns.Network, k: int, initial: str) -> str:
    code = (
        "import json, sys; from transports.hivemind.reachability import decide; "
        "print(json.dumps(decide('auto', initial_peers=[sys.argv[1]], announce_maddrs=())))"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(HERE), "src")}
    out = subprocess.run(
        [*net.wrap(k), sys.executable, "-c", code, initial],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    return json.loads(out.stdout)[0]


def _doctor(*sets: str, wrap: list[str] | None = None) -> tuple[int, str, float]:
    """``diloco doctor`` with these settings: its exit status, its lines, its seconds."""
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(HERE), "src")}
    words = [a for s in ("transport.kind=hivemind", f"transport.secret={json.dumps(SECRET)}",
                         "transport.run_id='nat'", *sets)
             for a in ("--set", s)]  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(
        [*(wrap or []), sys.executable, "-m", "diloco_train.cli", "doctor", *words],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_doctor_names_a_dead_initial_peer_in_seconds_and_fails():
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWBWyo2Vpfyh9Yh5Z91w6wmadQr9BHECxTUqRf6Zc4r3xo"
    code, out, seconds = _doctor(f"transport.initial_peers={json.dumps([dead])}")
    assert code == 1 and seconds < 10
    assert f"FAIL initial peer {dead}: no TCP connection (Connection refused)" in out
    assert "no initial peer answered" in out


def _rounds(peers: list[PeerProcess], n: int) -> list[list[dict]]:
    out = []
    for _ in range(n):
        for p in peers:
            p.send("round")
        out.append([p.next(120) for p in peers])
    return out


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_private_peers_behind_one_public_peer_average_with_everyone_and_a_private_joiner_joins(tmp_path):
    sockets_before = set(glob.glob("/tmp/hivemind-*.sock"))
    with netns.Network(peers=4, private=(1, 2, 3)) as net:
        public = f"/ip4/{net.address(0)}/tcp/4000/p2p/12D3KooWExample"
        assert _decide_in(net, 1, public) == "client"  # auto: its own address toward it is private
        assert _decide_in(net, 0, public) == "public"
        founder = {**BASE, "host_maddrs": [f"/ip4/{net.address(0)}/tcp/0"]}
        peers = [PeerProcess(0, founder, str(tmp_path / "0.log"), wrap=net.wrap(0))]
        try:
            addr = peers[0].next(60)["addr"]
            joiner = {**BASE, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "initial_peers": addr}
            for k in (1, 2):
                peers.append(PeerProcess(k, joiner, str(tmp_path / f"{k}.log"), wrap=net.wrap(k)))
                assert "addr" in peers[k].next(60)
            for p in peers:
                assert p.next(120)["ready"]
            # the doctor, where the late joiner will run: a client, relayed, the founder a member
            code, out, seconds = _doctor(f"transport.initial_peers={json.dumps(addr)}", wrap=net.wrap(3))
            assert code == 0 and seconds < 10, out
            assert "ok   this peer: client (its address 10.77.0.4 toward 11.77.0.1 is private" in out
            assert f"ok   initial peer {addr[0]}: a peer of this run; round trip" in out
            assert "ok   relay: others reach this peer at /ip4/11.77.0.1/" in out
            wrong = _doctor(
                f"transport.initial_peers={json.dumps(addr)}",
                "transport.run_id='other'",
                wrap=net.wrap(3),
            )
            assert wrong[0] == 1 and "answered as a peer of this run" in wrong[1], wrong
            rounds = _rounds(peers, 4)
            for results in rounds:  # before: a private peer averaged alone or with the public one only
                assert [r.get("contributors") for r in results] == [3, 3, 3], results
                assert len({r["digest"] for r in results}) == 1
                # clients own no parts (no payload crosses a relay): each sends the public peer its
                # payload P, which sends each client the 2 others' (4P)
                sent = [r["bytes_sent"] for r in results]
                assert sent[1] == sent[2] and sent[0] == 4 * sent[1] > 0, sent
            late = PeerProcess(3, joiner, str(tmp_path / "3.log"), wrap=net.wrap(3))
            peers.append(late)
            late.next(60)  # its addresses
            ready = late.next(120)
            assert ready["loaded"] and ready["digest"] == rounds[-1][0]["digest"]
            # in the next round: its presence is in the DHT before it begins one (else the others, not
            # expecting it, closed that round as 3 and it averaged alone, in 3 of 3 runs before)
            for results in _rounds(peers, 3):
                assert [r.get("contributors") for r in results] == [4, 4, 4, 4], results
                assert len({r["digest"] for r in results}) == 1
                sent = [r["bytes_sent"] for r in results]
                assert len(set(sent[1:])) == 1 and sent[0] == 9 * sent[1] > 0, sent
            assert exit_all(peers)
        finally:
            for p in peers:
                p.kill()
        names = [net.name(k) for k in range(4)]
    assert not set(names) & set(netns.namespaces())
    # the doctor whose bootstrap failed (wrong run id) left its daemon's socket file in /tmp
    assert procs.stale_sockets(set(glob.glob("/tmp/hivemind-*.sock")) - sockets_before) == set()

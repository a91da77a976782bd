"""How much one relayed connection of hivemind's p2p daemon carries: 1 MB from one client to another.

Not part of the test run; root only (network namespaces, ``tests/netns.py``). Per start: a public daemon
(hivemind ``P2P``, public reachability, its relay service on) and two clients behind it (private addresses,
listening on their own loopback, reserved on its relay as ``transport.reachability = "client"`` does); one
client sends the other ``--sends`` messages of 1 MB through the relay. Fresh daemons every start.

hivemind's p2pd configures its relay service with 4 GiB and 30 minutes per relayed connection, then starts
go-libp2p's default relay (128 KiB, 2 minutes) beside it; which one serves is decided as the daemon starts.
A start whose sends were all reset had the default one (``docs/wan.md``, "Behind NAT").

    PYTHONPATH=src python bench/relay_limit.py --starts 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import netns
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from transports.hivemind.reachability import relay_settings

PORT = 4000
MESSAGE = 1_000_000


async def _public(address: str) -> None:
    announce = [f"/ip4/{address}/tcp/{PORT}"]
    p2p = await P2P.create(
        host_maddrs=announce,
        **relay_settings("public", initial_peers=[], addresses=announce),
    )
    print(json.dumps([str(m) for m in await p2p.get_visible_maddrs()]), flush=True)
    await _until_stdin_closes(p2p)


async def _until_stdin_closes(p2p: P2P) -> None:
    """Serve until the parent closes our stdin, then shut down cleanly (hivemind removes its socket files
    on a clean shutdown only)."""
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await p2p.shutdown()


async def _client(initial: list[str]) -> P2P:
    p2p = await P2P.create(
        initial_peers=initial,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        **relay_settings("client", initial_peers=initial, addresses=[]),
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any("p2p-circuit" in str(m) for m in await p2p.get_visible_maddrs()):
            break
        await asyncio.sleep(0.1)
    return p2p


async def _receiver(initial: list[str]) -> None:
    p2p = await _client(initial)

    async def answer(request: runtime_pb2.Tensor, _context: object) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(buffer=str(len(request.buffer)).encode())

    await p2p.add_protobuf_handler("big", answer, runtime_pb2.Tensor)
    print(json.dumps(p2p.peer_id.to_base58()), flush=True)
    await _until_stdin_closes(p2p)


async def _sender(initial: list[str], *, to: str, sends: int) -> None:
    p2p = await _client(initial)
    done = 0
    for _ in range(sends):
        message = runtime_pb2.Tensor(buffer=b"x" * MESSAGE)
        try:
            call = p2p.call_protobuf_handler(PeerID.from_base58(to), "big", message, runtime_pb2.Tensor)
            done += (await asyncio.wait_for(call, 30)).buffer == str(MESSAGE).encode()
        except Exception as e:  # noqa: BLE001 - a reset or a timeout: counted as not through
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
    print(json.dumps({"through": done}), flush=True)
    await p2p.shutdown()


def _line(proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip():
            return line.strip()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"a peer exited ({proc.returncode}) before its first line")
    raise RuntimeError("no line from a peer within 60 s")


def _start(sends: int) -> int:
    """Messages of ``sends`` that went through in one start."""
    me = [sys.executable, __file__, "--role"]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with netns.Network(peers=3, private=(1, 2)) as net:
        public = net.popen(0, [*me, "public", net.address(0)], **pipes)
        initial = json.dumps([m for m in json.loads(_line(public)) if net.address(0) in m])
        receiver = net.popen(1, [*me, "receiver", initial], **pipes)
        to = json.loads(_line(receiver))
        sender = net.popen(2, [*me, "sender", initial, to, str(sends)], stdout=subprocess.PIPE, text=True)
        out = sender.communicate(timeout=60 + 40 * sends)[0]
        for server in (receiver, public):  # a clean shutdown: no socket file left in /tmp
            server.communicate(timeout=30)
        return json.loads(out.strip().splitlines()[-1])["through"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starts", type=int, default=4)
    p.add_argument("--sends", type=int, default=3)
    p.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        role, *rest = args.role
        if role == "public":
            asyncio.run(_public(rest[0]))
        elif role == "receiver":
            asyncio.run(_receiver(json.loads(rest[0])))
        else:
            asyncio.run(_sender(json.loads(rest[0]), to=rest[1], sends=int(rest[2])))
        return 0
    if (why := netns.available()) is not None:
        p.error(why)
    results = [_start(args.sends) for _ in range(args.starts)]
    for k, through in enumerate(results):
        print(f"start {k}: {through} of {args.sends} messages of 1 MB through the relay")
    print(f"starts whose every message went through: {sum(t == args.sends for t in results)} of {args.starts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

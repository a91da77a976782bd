"""Peers that join by address: the command another peer runs to join this one, and the ports they listen on.

The printed command is this peer's own, rewritten so that it can be pasted as is on another machine or on
this one: a run name of its own (``<name>-shard<K>``, each peer writes its own folder), the next data shard,
the listening addresses with port 0 (a free port: the first peer's fixed port is taken on this machine),
no announced addresses (they are this machine's), and this peer's addresses to join.
"""

from __future__ import annotations

import errno
import json
import re
import shlex
import socket
import sys
from collections.abc import Mapping
from typing import Any

from diloco_core import Membership, Transport
from transports import TransportSpec

from .config import TrainConfig

__all__ = ["check_ports", "join_command", "print_join"]

_LISTEN = "host_maddrs"  # where a peer listens, as multiaddrs (/ip4/<ip>/tcp/<port>)
_ANNOUNCE = "announce_maddrs"
_ADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/(tcp|udp)/(\d+)")


def check_ports(section: Mapping[str, Any]) -> None:
    """A fixed listening port already taken on this machine is a clear error before the transport starts
    (the transport itself reports it as a failure to reach its bootstrap peers)."""
    for addr in section.get(_LISTEN, ()):
        m = _ADDR.match(str(addr))
        if m is None or m.group(4) == "0":
            continue
        family = socket.AF_INET if m.group(1) == "ip4" else socket.AF_INET6
        kind = socket.SOCK_STREAM if m.group(3) == "tcp" else socket.SOCK_DGRAM
        with socket.socket(family, kind) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((m.group(2), int(m.group(4))))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    continue  # not this machine's address, say: the transport reports it
                raise ValueError(
                    f"transport.{_LISTEN}: port {m.group(4)} of {addr!r} is in use on this machine (another "
                    f"peer here?): give each peer on one machine its own port, or /{m.group(3)}/0 for a free one"
                ) from None


def _drop(argv: list[str], option: str, *, key: str | None = None) -> list[str]:
    """``argv`` without ``option VALUE`` / ``option=VALUE``; with ``key``, only ``--set key=...`` ones."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value, width = (argv[i + 1] if i + 1 < len(argv) else "", 2) if arg == option else (None, 1)
        if arg.startswith(option + "="):
            value = arg[len(option) + 1 :]
        if value is not None and (key is None or value.split("=", 1)[0].strip() == key):
            i += width
            continue
        out.append(arg)
        i += 1
    return out


def join_command(
    command: list[str],
    *,
    spec: TransportSpec,
    train: TrainConfig,
    run_name: str,
    addresses: list[str],
    settings: Mapping[str, str] | None = None,
) -> list[str]:
    """``command`` (this peer's argv) rewritten for the next peer (module docstring), joining ``addresses``.
    ``settings``: [transport] settings a joiner needs that this peer made up (hivemind: a generated secret)."""
    section, join = spec.section, f"transport.{spec.join_key}"
    settings = dict(settings or {})
    argv = _drop(list(command), "--name")
    for key in (
        "train.shard",
        f"transport.{_LISTEN}",
        f"transport.{_ANNOUNCE}",
        join,
        *(f"transport.{k}" for k in settings),
    ):
        argv = _drop(argv, "--set", key=key)
    shard = (train.shard + 1) % train.num_shards if train.num_shards > 0 else max(train.shard, 0)
    argv += ["--name", f"{run_name}-shard{shard}", "--set", f"train.shard={shard}"]
    if _LISTEN in section:
        free = [_ADDR.sub(lambda m: f"/{m[1]}/{m[2]}/{m[3]}/0", str(a)) for a in section[_LISTEN]]
        argv += ["--set", f"transport.{_LISTEN}={json.dumps(free)}"]
    if section.get(_ANNOUNCE):
        argv += ["--set", f"transport.{_ANNOUNCE}=[]"]
    for key, value in settings.items():
        argv += ["--set", f"transport.{key}={json.dumps(value)}"]
    return [*argv, "--set", f"{join}={json.dumps(addresses)}"]


def print_join(
    transport: Transport, *, spec: TransportSpec, train: TrainConfig, command: list[str] | None, run_name: str
) -> None:
    """Where peers join by address, show the command that joins another one to this run."""
    if not isinstance(transport, Membership) or not transport.join_addresses or spec.join_key is None:
        return
    argv = join_command(
        list(command or ["diloco", "train"]),
        spec=spec,
        train=train,
        run_name=run_name,
        addresses=list(transport.join_addresses),
        settings=getattr(transport, "join_settings", None),  # hivemind: the secret its first peer generated
    )
    print(
        "another peer joins with (here or on another machine; each further peer with its own --name and "
        "train.shard):\n  " + shlex.join(argv),
        file=sys.stderr,
        flush=True,
    )

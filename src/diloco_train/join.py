"""Peers that join by address: the command another peer runs to join this one, and the ports they listen on.

The printed command is this peer's own, rewritten so that it can be pasted as is on another machine or on
this one: a run name of its own (``<name>-shard<K>``, each peer writes its own folder), the next data shard,
the listening addresses with port 0 (a free port: the first peer's fixed port is taken on this machine),
no announced addresses (they are this machine's), and this peer's addresses to join.

It never carries a secret (``TransportSpec.secret_keys``): a command line is readable by every user of the
machine (``ps``) and a printed line ends up in logs. A secret this peer generated, or was given on its
command line, is written to ``join.secret`` in its run folder (mode 0600) and the command names that file
(``transport.secret_file``); a secret from a file or an environment variable is named as this peer's was.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diloco_core import Membership, Transport
from transports import TransportSpec

from .config import TrainConfig

__all__ = ["SECRET_FILE", "check_ports", "join_command", "print_join", "set_keys", "write_secret"]

_LISTEN = "host_maddrs"  # where a peer listens, as multiaddrs (/ip4/<ip>/tcp/<port>)
_ANNOUNCE = "announce_maddrs"
_ADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/(tcp|udp)/(\d+)")
SECRET_FILE = "join.secret"
"""The file in a run folder that holds a secret the join command names instead of showing it."""

logger = logging.getLogger(__name__)


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
    ``settings``: [transport] settings a joiner needs that this command does not give (hivemind: the file
    holding the secret). A secret of ``spec.secret_keys`` given in ``command`` is left out."""
    section, join = spec.section, f"transport.{spec.join_key}"
    settings = dict(settings or {})
    argv = _drop(list(command), "--name")
    for key in (
        "train.shard",
        f"transport.{_LISTEN}",
        f"transport.{_ANNOUNCE}",
        join,
        *(f"transport.{k}" for k in [*settings, *spec.secret_keys]),
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


def set_keys(command: list[str]) -> set[str]:
    """The keys ``command`` sets with ``--set KEY=VALUE`` or ``--set=KEY=VALUE``."""
    values = [b for a, b in itertools.pairwise(command) if a == "--set"]
    values += [a.removeprefix("--set=") for a in command if a.startswith("--set=")]
    return {v.split("=", 1)[0].strip() for v in values if "=" in v}


def write_secret(path: Path, secret: str) -> Path:
    """``secret`` in the file ``path``, readable by its owner only (an existing file is overwritten, its mode
    made 0600 first): the absolute path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secret + "\n").encode("utf-8"))
    finally:
        os.close(fd)
    return path.resolve()


def _shared_secret(transport: Transport, spec: TransportSpec, command: list[str]) -> str | None:
    """The secret a joiner needs that no setting of ``command`` names: generated by this peer, or given on its
    command line (visible there to every local user: said so)."""
    generated = (getattr(transport, "join_settings", None) or {}).get("secret")
    if generated is not None:
        return generated
    for key in sorted(spec.secret_keys):
        if f"transport.{key}" in set_keys(command) and spec.section.get(key) is not None:
            logger.warning(
                "transport.%s on the command line is readable by every user of this machine (ps) while the run "
                "lasts: use transport.secret_file (a file of mode 600) or transport.secret_env instead",
                key,
            )
            return str(spec.section[key])
    return None


def print_join(
    transport: Transport, *, spec: TransportSpec, train: TrainConfig, command: list[str] | None, run_dir: Path
) -> None:
    """Where peers join by address, show the command that joins another one to this run (never its secret:
    the module docstring)."""
    if not isinstance(transport, Membership) or not transport.join_addresses or spec.join_key is None:
        return
    command = list(command or ["diloco", "train"])
    secret = _shared_secret(transport, spec, command)
    path = None if secret is None else write_secret(run_dir / SECRET_FILE, secret)
    argv = join_command(
        command,
        spec=spec,
        train=train,
        run_name=run_dir.name,
        addresses=list(transport.join_addresses),
        settings=None if path is None else {"secret_file": str(path)},
    )
    where = "" if path is None else f"\n(the run's secret is in {path}: copy it there on another machine, mode 600)"
    print(
        "another peer joins with (here or on another machine; each further peer with its own --name and "
        "train.shard):\n  " + shlex.join(argv) + where,
        file=sys.stderr,
        flush=True,
    )

"""Peers that join by address: the command another peer runs to join this one, and the ports they listen on.

The printed command is built from this peer's effective config (its defaults, files, ``--set`` and, after
``--resume``, the run's saved config, merged), not from its command line: ``diloco train`` and every setting
that differs from the trainer's defaults, so that it can be pasted as is on another machine (no config file
needed) or on this one, also after a resume (a resumed peer's argv names almost nothing). Rewritten: a run
name of its own (``<name>-shard<K>``, each peer writes its own folder), the next data shard, the listening
addresses with port 0 (a free port: the first peer's fixed port is taken on this machine), no announced
addresses (they are this machine's), and this peer's addresses to join.

It never carries a secret (``TransportSpec.secret_keys``): a command line is readable by every user of the
machine (``ps``) and a printed line ends up in logs. A secret this peer generated, or was given as a value (in
a config file or on its command line), is written to ``join.secret`` in its run folder (mode 0600) and the
command names that file (``transport.secret_file``); a secret from a file or an environment variable is named
as this peer's was.
A resumed peer that names no secret reads that file again (``stored_secret``): it keeps the run's secret.
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import tomli_w

from diloco_core import Membership, Transport
from transports import TransportSpec, transport_spec

from ..run_config import RunConfig, build_config
from .run_folder import RunFolder

__all__ = ["check_ports", "join_command", "print_join", "set_keys", "stored_secret", "write_secret"]

_LISTEN = "host_maddrs"  # where a peer listens, as multiaddrs (/ip4/<ip>/tcp/<port>)
_ANNOUNCE = "announce_maddrs"
_ADDR = re.compile(r"^/(ip4|ip6)/([^/]+)/(tcp|udp)/(\d+)")
_UNSET = object()
_SECRET_SOURCES = ("secret_file", "secret_env")  # where a peer reads the secret that no argv shows
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


def _literal(value: Any) -> str:
    """``value`` as the TOML literal that ``--set`` reads back (``config.parse_override``)."""
    return tomli_w.dumps({"v": value}).strip().removeprefix("v = ")


def join_command(
    config: RunConfig,
    *,
    spec: TransportSpec,
    run_name: str,
    addresses: list[str],
    settings: Mapping[str, str] | None = None,
) -> list[str]:
    """The command that joins the next peer to a peer running ``config`` (its effective config: defaults,
    files, ``--set`` and a resumed run's saved config merged; module docstring), joining ``addresses``.
    Every setting that differs from the trainer's defaults is given with ``--set``, so that the command
    needs no file of this machine but the data and the secret's file. ``settings``: [transport] settings
    a joiner needs that ``config`` does not give (hivemind: the file holding the secret). A secret of
    ``spec.secret_keys`` is left out."""
    train = config.train
    settings = dict(settings or {})
    shard = (train.shard + 1) % train.num_shards if train.num_shards > 0 else max(train.shard, 0)
    defaults = build_config().to_dict()
    skip = {
        "train.shard",
        f"transport.{_LISTEN}",
        f"transport.{_ANNOUNCE}",
        f"transport.{spec.join_key}",
    }
    skip |= {f"transport.{k}" for k in [*settings, *spec.secret_keys]}
    # a joiner's join command: wan-shard2, not wan-shard1-shard2
    base = re.sub(r"-shard\d+$", "", run_name)
    argv = ["diloco", "train", "--name", f"{base}-shard{shard}", "--set", f"train.shard={shard}"]
    for name, table in config.to_dict().items():
        for key, value in table.items():
            if f"{name}.{key}" not in skip and defaults.get(name, {}).get(key, _UNSET) != value:
                argv += ["--set", f"{name}.{key}={_literal(value)}"]
    section = spec.section
    if _LISTEN in section:
        free = [_ADDR.sub(lambda m: f"/{m[1]}/{m[2]}/{m[3]}/0", str(a)) for a in section[_LISTEN]]
        argv += ["--set", f"transport.{_LISTEN}={json.dumps(free)}"]
    if section.get(_ANNOUNCE):
        argv += ["--set", f"transport.{_ANNOUNCE}=[]"]
    for key, value in settings.items():
        argv += ["--set", f"transport.{key}={json.dumps(value)}"]
    return [*argv, "--set", f"transport.{spec.join_key}={json.dumps(addresses)}"]


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


def stored_secret(config: RunConfig, run_dir: Path) -> RunConfig:
    """``config`` of a resumed peer, with the secret its run stored (``RunFolder.join_secret``: the one it generated, or was
    given on its command line) where it names none: else a first peer would generate a new secret, and no peer
    of the run could meet it again. Said in one line."""
    spec = transport_spec(config.transport)
    path = RunFolder(run_dir).join_secret
    named = any(k in config.transport for k in (*spec.secret_keys, *_SECRET_SOURCES))
    if spec.join_key is None or named or not path.is_file():
        return config
    print(
        f"run {run_dir}: the run's secret is read from {path} (stored when the run started)",
        file=sys.stderr,
    )
    return replace(config, transport={**config.transport, "secret_file": str(path.resolve())})


def _shared_secret(transport: Transport, spec: TransportSpec, command: list[str]) -> str | None:
    """The secret a joiner needs that no setting of the join command names: generated by this peer, or given
    as a value (in a config file, which the other machine does not have, or on the command line, visible there
    to every local user: said so)."""
    generated = (getattr(transport, "join_settings", None) or {}).get("secret")
    if generated is not None:
        return generated
    for key in sorted(spec.secret_keys):
        if spec.section.get(key) is None:
            continue
        if f"transport.{key}" in set_keys(command):
            logger.warning(
                "transport.%s on the command line is readable by every user of this machine (ps) while the run "
                "lasts: use transport.secret_file (a file of mode 600) or transport.secret_env instead",
                key,
            )
        return str(spec.section[key])
    return None


def print_join(
    transport: Transport,
    *,
    spec: TransportSpec,
    config: RunConfig,
    command: list[str] | None,
    run_dir: Path,
) -> None:
    """Where peers join by address, show the command that joins another one to this run (never its secret:
    the module docstring)."""
    if (
        not isinstance(transport, Membership)
        or not transport.join_addresses
        or spec.join_key is None
    ):
        return
    command = list(command or ["diloco", "train"])
    secret = _shared_secret(transport, spec, command)
    path = None if secret is None else write_secret(RunFolder(run_dir).join_secret, secret)
    argv = join_command(
        config,
        spec=spec,
        run_name=run_dir.name,
        addresses=list(transport.join_addresses),
        settings=None if path is None else {"secret_file": str(path)},
    )
    where = (
        ""
        if path is None
        else f"\n(the run's secret is in {path}: copy it there on another machine, mode 600)"
    )
    print(
        "another peer joins with (here or on another machine; each further peer with its own --name and "
        "train.shard):\n  " + shlex.join(argv) + where,
        file=sys.stderr,
        flush=True,
    )

"""Where a hivemind run's secret comes from: ``HivemindConfig.secret``, ``secret_file`` or ``secret_env``.

A secret given on the command line (``--set transport.secret=...``) is in the argv of every process of the
peer (its DHT and averager processes are forks of it: 4 processes per peer), and any local user reads argv
with ``ps``. A file that only its owner can read (mode 0600) or an environment variable (``/proc/PID/environ``
is readable by the same user and root only) is not: there, only the path or the variable's name is in argv.
hivemind's p2p daemon never gets the secret (only the DHT process's address and keys of its own).
"""

from __future__ import annotations

import os
import stat
from typing import Protocol

from diloco_core.rules import check_field

__all__ = ["SOURCES", "check_sources", "read_secret"]

SOURCES = ("secret", "secret_file", "secret_env")
"""The config fields that can give the run's secret: at most one of them is set."""


class _Sources(Protocol):
    secret: str | None
    secret_file: str | None
    secret_env: str | None


def check_sources(config: _Sources) -> None:
    """``ValueError`` where more than one of ``SOURCES`` is set (which one would win is not obvious)."""
    given = [name for name in SOURCES if getattr(config, name) is not None]
    check_field(
        "secret/secret_file/secret_env",
        f"{len(given)} set ({', '.join(given)})",
        ok=len(given) <= 1,
        valid="at most one of them set",
    )


def read_secret(config: _Sources) -> str | None:
    """The run's secret from whichever source the config names (None: none, the first peer generates one)."""
    if config.secret_file is not None:
        return _read_file(config.secret_file)
    if config.secret_env is not None:
        value = os.environ.get(config.secret_env, "").strip()
        check_field(
            "secret_env",
            config.secret_env,
            ok=value != "",
            valid=f"the name of a set, non-empty environment variable (${config.secret_env} is unset or empty)",
        )
        return value
    return config.secret


def _read_file(path: str) -> str:
    """The file's text without surrounding whitespace; refused if its group or others may read it."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise ValueError(
            f"secret_file={path!r} is invalid: expected a readable file ({e.strerror})"
        ) from None
    check_field("secret_file", path, ok=stat.S_ISREG(info.st_mode), valid="a regular file")
    mode = stat.S_IMODE(info.st_mode)
    check_field(
        "secret_file",
        path,
        # POSIX permissions only: elsewhere (Windows) the mode bits say nothing about other users.
        ok=os.name != "posix" or mode & 0o077 == 0,
        valid=f"a file only its owner can read (it has mode {mode:04o}: run chmod 600 {path})",
    )
    with open(path, encoding="utf-8") as f:
        value = f.read().strip()
    check_field(
        "secret_file", path, ok=value != "", valid="a file holding the secret (it is empty)"
    )
    return value

"""A run's name: the one given, else one made of the mode and the time, which every rank of a run shares."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from diloco_core import Transport
from transports import transport_spec

from ..run_config import RunConfig
from ..train_config import TrainConfig

__all__ = ["agree_run_dir", "check_name", "default_name", "resume_command"]

_MAX_BYTES = 255  # a file name's limit on common file systems


_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""POSIX's portable file name characters, a letter or digit first (a leading '-' reads as an option): no
separator, space, control character or escape sequence, nothing a shell or a terminal reads otherwise."""


def check_name(name: str) -> str:
    """``name`` if it names a folder directly inside ``train.runs_dir``; else a ValueError saying what is valid."""
    if not _SAFE.fullmatch(name):
        raise ValueError(
            f"--name {name!r} is invalid: expected a folder name inside train.runs_dir of ASCII letters, digits, "
            "'.', '_' and '-', starting with a letter or digit (set train.runs_dir to write elsewhere)"
        )
    if len(name.encode("utf-8")) > _MAX_BYTES:
        raise ValueError(
            f"--name {name!r} is invalid: expected at most {_MAX_BYTES} bytes (a file name's limit)"
        )
    return name


def default_name(mode: str) -> str:
    """``<mode>-<date>-<time>``, to the second: processes started apart pick different names."""
    return f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}"


def agree_run_dir(transport: Transport, run_dir: Path, *, timeout: float) -> Path:
    """Rank 0's run folder name, for every rank of ``transport`` (its ranks' own picks may be a second apart).
    Collective: every rank calls it."""
    raw = run_dir.name.encode("utf-8")
    if len(raw) > _MAX_BYTES:
        raise ValueError(f"run name {run_dir.name!r} is longer than {_MAX_BYTES} bytes")
    buf = torch.zeros(_MAX_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    transport.broadcast([buf], src=0, timeout=timeout)
    name = bytes(buf.tolist()).rstrip(b"\0").decode("utf-8")
    return run_dir.with_name(name)


def resume_command(
    name: str,
    config: RunConfig,
    *,
    launcher: Sequence[str] = ("diloco",),
    secret_stored: bool = False,
) -> str:
    """The command line that continues run ``name``: its runs_dir where not the default, and a placeholder
    for each [transport] secret (never saved with the config) unless ``secret_stored``: the run folder holds it
    (``RunFolder.join_secret``), which a resume reads. ``launcher``: what comes before ``train``."""
    argv = [*launcher, "train", "--resume", "--name", name]
    if config.train.runs_dir != TrainConfig.runs_dir:
        argv += ["--set", f"train.runs_dir={json.dumps(config.train.runs_dir)}"]
    spec = transport_spec(config.transport)
    secrets = (
        []
        if secret_stored
        else [f'transport.{k}="..."' for k in sorted(spec.secret_keys) if k in spec.section]
    )
    return shlex.join(argv) + "".join(f" --set '{s}'" for s in secrets)

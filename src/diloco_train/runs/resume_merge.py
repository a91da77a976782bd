"""``--resume`` with ``--config`` or ``--set``: the files and overrides apply on top of the run's saved config.

Each changed key is said in one line. A change that the checkpoints cannot continue exactly (the model, the
data, the workers, the schedule, DiLoCo's settings: any key not listed in ``SAFE``) is refused unless
``--force``: the run would then no longer be the run that was interrupted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transports import transport_spec

from ..run_config import RunConfig, build_config

__all__ = ["SAFE", "merge_onto_saved"]

SAFE = frozenset(
    {
        "train.runs_dir",
        "train.eval_every",
        "train.eval_batches",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.max_nonfinite_losses",
        "train.threads",
        "train.log_to",
        "diloco.reduce_timeout",
        "data.streaming",
        "data.token_cache",
    }
)
"""Keys a resume may change and still continue the run exactly: where files go, evals, checkpoints, timeouts,
whether the tokens are read from memory or from a token file (the same tokens in the same order either way)
(and every [transport] key but its kind: addresses and secrets change from one start to the next)."""


def _flat(config: RunConfig) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, table in config.to_dict().items() for k, v in table.items()}


def _safe(key: str) -> bool:
    return key in SAFE or (key.startswith("transport.") and key != "transport.kind")


def merge_onto_saved(
    saved: Mapping[str, Any],
    *,
    files: Sequence[str | Path],
    overrides: Sequence[str],
    force: bool,
) -> tuple[RunConfig, list[str]]:
    """The config the run continues with, and one line per key that ``files`` and ``overrides`` change in
    ``saved`` (a secret's value never shown). ValueError naming the keys that would break exact resume,
    unless ``force``."""
    before = _flat(build_config((), (), base=saved))
    config = build_config(files, overrides, base=saved)
    after = _flat(config)
    secret_keys = transport_spec(config.transport).secret_keys
    lines, unsafe = [], []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key, "(unset)"), after.get(key, "(unset)")
        if old == new:
            continue
        secret = key.startswith("transport.") and key.removeprefix("transport.") in secret_keys
        lines.append(f"{key}: (secret, changed)" if secret else f"{key}: {old!r} -> {new!r}")
        if not _safe(key):
            unsafe.append(key)
    if unsafe and not force:
        raise ValueError(
            f"--resume cannot continue the run exactly with {', '.join(unsafe)} changed "
            f"({'; '.join(line for line in lines if line.split(':')[0] in unsafe)}): drop the change, "
            "or pass --force to continue with it anyway"
        )
    return config, lines

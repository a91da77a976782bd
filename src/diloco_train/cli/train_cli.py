"""``diloco train``'s parser: its options, an example, and every config key with its default."""

from __future__ import annotations

import argparse

__all__ = ["TRAIN_EXAMPLE", "config_keys", "configure_train_parser"]

TRAIN_EXAMPLE = "e.g. diloco train --set train.steps=200 --set diloco.inner_steps=50"


def config_keys() -> str:
    """Every config section and key with its default, read from the dataclasses (docs/trainer.md explains them)."""
    from dataclasses import MISSING, fields

    from transports import TRANSPORT_KINDS

    from ..run_config import SECTIONS, TRAINER_DEFAULTS

    lines = [
        "config keys (--set SECTION.KEY=VALUE or a TOML table; defaults shown; docs/trainer.md):"
    ]
    for name, cls in SECTIONS.items():
        keys = []
        for f in fields(cls):
            if not f.init or not f.repr:  # not a key to show: a deprecated alias
                continue
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            default = TRAINER_DEFAULTS.get(name, {}).get(f.name, default)
            keys.append(f"{f.name}={default!r}")
        lines.append(f"  [{name}] " + ", ".join(keys))
    kinds = ", ".join(repr(k) for k in TRANSPORT_KINDS)
    lines.append(
        f"  [transport] kind: one of {kinds} (default 'inprocess'), and its transport's keys (docs/lan.md, wan.md)"
    )
    return "\n".join(lines)


def configure_train_parser(p: argparse.ArgumentParser) -> None:
    """``diloco train``'s options on ``p``."""
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE.toml",
        help="TOML file with [model] [data] [train] [diloco] [transport] tables (repeatable; later wins)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        help="override one key; VALUE is a TOML literal (a bare word is a string). Repeatable",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue run NAME from its latest checkpoint, with its saved config (--config/--set change it: "
        "each change is printed; one that breaks exact resume needs --force)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --resume: accept changes of the model, data, workers, schedule or DiLoCo settings",
    )
    p.add_argument(
        "--name",
        metavar="RUN",
        help="run name: files go to <train.runs_dir>/RUN/ (default: mode-time)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log one line per round and worker")

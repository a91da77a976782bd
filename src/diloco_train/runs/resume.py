"""Resuming a run: its folder, each worker's checkpoint (what it holds; ``resume_from``: which step all
ranks resume from).

Every rank writes its own checkpoint file, because each holds its own inner optimizer and data order. A
resume changes nothing in the run folder (config.toml, metrics.jsonl) until every worker has loaded its
checkpoint: then rank 0 commits it (``commit_resume``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from diloco_core import Transport

from ..run_config import RunConfig, dump_toml
from .checkpoint import load_checkpoint
from .metrics_file import truncate_metrics
from .rank_files import RankFiles
from .resume_from import from_every_rank
from .run_folder import RunFolder

__all__ = [
    "check_resume_workers",
    "checkpoint_due",
    "commit_resume",
    "confirm_loaded",
    "load_worker",
    "prepare_run_dir",
    "save_worker",
    "write_config",
]

_CHECKPOINT_FORMAT = 1

logger = logging.getLogger(__name__)


def prepare_run_dir(
    run_dir: Path, config: RunConfig, *, resume: bool, secret_keys: Collection[str]
) -> None:
    """Refuse to overwrite a run unless resuming; a new run's config.toml is written here, a resumed run's
    once its resume succeeded (``commit_resume``)."""
    folder = RunFolder(run_dir)
    if not resume and (folder.metrics.exists() or folder.checkpoints.exists()):
        raise ValueError(
            f"run {str(run_dir)!r} already exists: pass --resume to continue it, or another --name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_config(run_dir, config, secret_keys=secret_keys)


def write_config(run_dir: Path, config: RunConfig, *, secret_keys: Collection[str]) -> None:
    """The run's config.toml, ``secret_keys`` of [transport] left out."""
    tables = config.to_dict()
    tables["transport"] = {
        k: v for k, v in tables["transport"].items() if k not in secret_keys
    }  # never on disk
    RunFolder(run_dir).config.write_text(dump_toml(tables), encoding="utf-8")


def check_resume_workers(run_dir: Path, world_size: int) -> None:
    """Where every worker's checkpoint is on this disk, a changed worker count (by the checkpoints' own record
    of it) or a worker without checkpoints is caught up front."""
    run = RunFolder(run_dir)
    ranks = run.checkpoint_ranks()
    if not ranks:
        return  # nothing to resume
    recorded = _recorded_world(run.rank(ranks[0])) or len(ranks)
    if recorded != world_size:
        raise ValueError(
            f"run {str(run_dir)!r} was checkpointed with {recorded} worker(s); "
            f"this run has {world_size} (set train.workers={recorded}, or start a new run)"
        )
    missing = [r for r in range(recorded) if r not in ranks]
    if missing:
        raise ValueError(
            f"run {str(run_dir)!r} has no checkpoint of worker(s) {missing} of its {recorded} in {str(run.checkpoints)!r} "
            "(deleted, or never written): every worker needs its own to resume; start a new run"
        )


def _recorded_world(files: RankFiles) -> int | None:
    """The worker count that a rank's newest readable checkpoint records (None: none can be read, which
    ``resume_from`` reports). Read memory-mapped: only the small entries are read."""
    for step in reversed(files.steps()):
        try:
            state = torch.load(
                files.checkpoint(step), map_location="cpu", weights_only=True, mmap=True
            )
        except Exception:  # noqa: BLE001, S112 - unreadable: resume_from warns about it and tries an older one
            continue
        return (
            int(state["world_size"]) if isinstance(state, dict) and "world_size" in state else None
        )
    return None


def confirm_loaded(transport: Transport | None, timeout: float) -> None:
    """Return once every rank of a fixed-ranks run has loaded its checkpoint (collective); where ranks come
    and go, each peer is on its own."""
    if transport is not None and transport.capabilities.fixed_ranks and transport.world_size > 1:
        from_every_rank(transport, 1, timeout)


def commit_resume(
    run_dir: Path, *, step: int, config: RunConfig, secret_keys: Collection[str]
) -> None:
    """Rank 0, once every worker has loaded the checkpoint of ``step`` (-1: there was none): drop what was
    logged after it (everything, with none), write the config the run continues with, tell the user."""
    if step < 0:
        logger.warning("run %s has no checkpoint yet: starting it from step 0", run_dir)
        # what was logged is from a run that starts over
        RunFolder(run_dir).metrics.unlink(missing_ok=True)
    else:
        truncate_metrics(run_dir, step)
        end = min(config.train.stop_after or config.train.steps, config.train.steps)
        print(
            f"run {run_dir}: resumed from step {step} of {config.train.steps}, to step {end}",
            file=sys.stderr,
        )
    write_config(run_dir, config, secret_keys=secret_keys)


def checkpoint_due(step: int, *, end: int, inner_steps: int, every: int) -> bool:
    """At the last step, and every ``every`` rounds of ``inner_steps`` steps (in every mode); 0: only at the end."""
    return step == end or (
        every > 0 and step % inner_steps == 0 and (step // inner_steps) % every == 0
    )


_SHARED = ("global", "outer_optimizer")
"""DiLoCo's state that is the same on every worker: the global copy and the outer optimizer (its momentum)."""


def save_worker(
    run_dir: Path,
    *,
    step: int,
    rank: int,
    world_size: int,
    config: RunConfig,
    core: dict[str, Any],
    data: Any,
    same_disk: bool = False,
) -> None:
    """Write ``rank``'s checkpoint of ``step``: its mode's state (``core``) and its data position (``data``).
    ``same_disk``: every worker's files are in this folder (in-process workers), so ranks but 0 leave out
    the state that every worker holds the same, and take rank 0's of the same step when they load."""
    t = config.train
    shared = [k for k in _SHARED if k in core] if same_disk and rank > 0 else []
    core = {k: v for k, v in core.items() if k not in shared}
    state = {
        "format": _CHECKPOINT_FORMAT,
        "mode": t.mode,
        "rank": rank,
        "world_size": world_size,
        "step": step,
        "core": core,
        "data": data,
        "from_rank0": shared,
    }
    RunFolder(run_dir).rank(rank).save(step, state, keep=t.keep_checkpoints)


def load_worker(
    run_dir: Path,
    *,
    state: dict[str, Any],
    step: int,
    world_size: int,
    config: RunConfig,
    fixed_ranks: bool,
) -> dict[str, Any]:
    """``state``, a rank's checkpoint of ``step`` (``resume_from``), checked against this run: same mode and,
    where ranks hold for the run (``fixed_ranks``; else group sizes change from round to round), the same
    number of workers; the state every in-process worker shares is taken from rank 0's file of ``step``."""
    if state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {state.get('format')!r} is not {_CHECKPOINT_FORMAT}")
    mode = config.train.mode
    if state["mode"] != mode or (fixed_ranks and state["world_size"] != world_size):
        raise ValueError(
            f"the checkpoint is of a {state['mode']} run with {state['world_size']} worker(s); "
            f"this run is {mode} with {world_size}"
        )
    if state.get("from_rank0"):
        lead = load_checkpoint(RunFolder(run_dir).rank(0).checkpoint(step))["core"]
        state["core"].update({k: lead[k] for k in state["from_rank0"]})
    return state

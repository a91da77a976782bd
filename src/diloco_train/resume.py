"""Resuming a run: its folder, each worker's checkpoint (what it holds, which step all ranks resume from).

Every rank writes its own checkpoint file, because each holds its own inner optimizer and data order.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from diloco_core import Transport

from .checkpoint import checkpoint_path, list_checkpoints, load_checkpoint, save_checkpoint
from .config import RunConfig, dump_toml
from .metrics import METRICS

__all__ = [
    "check_resume_workers",
    "checkpoint_due",
    "load_worker",
    "prepare_run_dir",
    "resume_step",
    "save_worker",
]

_CHECKPOINT_FORMAT = 1


def prepare_run_dir(run_dir: Path, config: RunConfig, *, resume: bool, secret_keys: Collection[str]) -> None:
    """Refuse to overwrite a run unless resuming; write its config.toml, ``secret_keys`` of [transport] left out."""
    metrics = run_dir / METRICS
    if resume:
        if not list_checkpoints(run_dir / "checkpoints", 0):
            metrics.unlink(missing_ok=True)  # nothing to resume: what was logged is from a run that starts over
    elif metrics.exists() or (run_dir / "checkpoints").exists():
        raise ValueError(f"run {str(run_dir)!r} already exists: pass --resume to continue it, or another --name")
    run_dir.mkdir(parents=True, exist_ok=True)
    tables = config.to_dict()
    tables["transport"] = {k: v for k, v in tables["transport"].items() if k not in secret_keys}  # never on disk
    (run_dir / "config.toml").write_text(dump_toml(tables), encoding="utf-8")


def check_resume_workers(run_dir: Path, world_size: int) -> None:
    """Where every worker's checkpoint is on this disk, a changed worker count is caught up front."""
    folder = run_dir / "checkpoints"
    if not list_checkpoints(folder, 0):
        return  # nothing to resume
    have = 0
    while list_checkpoints(folder, have):
        have += 1
    if have != world_size:
        raise ValueError(
            f"run {str(run_dir)!r} was checkpointed with {have} worker(s); "
            f"this run has {world_size} (set train.workers={have}, or start a new run)"
        )


def _common_step(transport: Transport | None, steps: list[int], timeout: float) -> int:
    """The newest checkpoint step every rank holds (-1: none). A worker killed mid-checkpoint leaves its
    peers one checkpoint ahead of it; all then resume from the step they have in common."""
    latest = steps[-1] if steps else -1
    if transport is None or transport.world_size == 1:
        return latest
    everyone = []
    for src in range(transport.world_size):
        value = torch.tensor([latest], dtype=torch.int64)
        transport.broadcast([value], src=src, timeout=timeout)
        everyone.append(int(value.item()))
    common = min(everyone)
    if common >= 0 and common not in steps:
        raise ValueError(
            f"workers hold no common checkpoint: their latest steps are {everyone}, and rank {transport.rank} "
            f"has {steps} (keep_checkpoints may be too small)"
        )
    return common


def resume_step(run_dir: Path, *, rank: int, transport: Transport | None, timeout: float) -> int:
    """The step ``rank`` resumes from (-1: no checkpoint yet). Ranks that hold for the run agree on it;
    peers that come and go have no ranks to agree, and each takes its own newest."""
    steps = list_checkpoints(run_dir / "checkpoints", rank)
    if transport is None or transport.fixed_ranks:
        return _common_step(transport, steps, timeout)
    return steps[-1] if steps else -1


def checkpoint_due(step: int, *, end: int, inner_steps: int, every: int) -> bool:
    """At the last step, and every ``every`` rounds of ``inner_steps`` steps (in every mode); 0: only at the end."""
    return step == end or (every > 0 and step % inner_steps == 0 and (step // inner_steps) % every == 0)


def save_worker(
    run_dir: Path, *, step: int, rank: int, world_size: int, config: RunConfig, core: dict[str, Any], data: Any
) -> None:
    """Write ``rank``'s checkpoint of ``step``: its mode's state (``core``) and its data position (``data``)."""
    t = config.train
    state = {
        "format": _CHECKPOINT_FORMAT,
        "mode": t.mode,
        "rank": rank,
        "world_size": world_size,
        "step": step,
        "core": core,
        "data": data,
    }
    save_checkpoint(run_dir / "checkpoints", step=step, rank=rank, state=state, keep=t.keep_checkpoints)


def load_worker(
    run_dir: Path, *, step: int, rank: int, world_size: int, config: RunConfig, fixed_ranks: bool
) -> dict[str, Any]:
    """``rank``'s checkpoint of ``step``, checked against this run: same mode and, where ranks hold for the
    run (``fixed_ranks``; else group sizes change from round to round), the same number of workers."""
    state = load_checkpoint(checkpoint_path(run_dir / "checkpoints", step, rank))
    if state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {state.get('format')!r} is not {_CHECKPOINT_FORMAT}")
    mode = config.train.mode
    if state["mode"] != mode or (fixed_ranks and state["world_size"] != world_size):
        raise ValueError(
            f"the checkpoint is of a {state['mode']} run with {state['world_size']} worker(s); "
            f"this run is {mode} with {world_size}"
        )
    return state

"""Where a run's metrics records go besides metrics.jsonl (``train.log_to``): TensorBoard event files in the
run folder, or wandb. Each sink sees the records rank 0 writes, as scalars named by ``scalars_of``.

Both libraries are optional extras (``diloco[tensorboard]``, ``diloco[wandb]``), imported only by a run that
asks for them; a missing one is a one-line ValueError before the run starts (``check_sinks``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..run_config import load_toml
from ..runs.run_folder import RunFolder
from ..train_config import SINKS  # the values train.log_to may list

__all__ = ["SINKS", "Sink", "check_sinks", "open_sinks", "scalars_of"]

"""The event files' folder inside the run folder."""

# Per record type: its fields logged, as "<prefix>/<field>" (the step is the x of every scalar).
_FIELDS = {
    "step": (
        "train",
        ("loss", "lr", "tokens_per_s", "compute_s", "comm_s", "bytes_sent", "time_s"),
    ),
    "eval": ("eval", ("loss", "perplexity", "eval_s")),
    "round": (
        "round",
        ("num_contributors", "bytes_sent", "comm_s", "round_s", "agreement", "pseudo_grad_norm"),
    ),
    "summary": ("summary", ("wall_s", "utilization", "goodput", "bytes_sent", "eval_after")),
}


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers a sink logs: ``{"train/loss": 2.1, ...}`` for a step record ({} for other types)."""
    prefix, names = _FIELDS.get(record.get("type", ""), ("", ()))
    return {
        f"{prefix}/{n}": float(record[n]) for n in names if isinstance(record.get(n), (int, float))
    }


class Sink(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files in ``<run>/tensorboard/`` (``tensorboard --logdir runs/NAME/tensorboard``). A run resumed from
    step S adds a file there that tells TensorBoard to drop the earlier files' steps after S, as
    metrics.jsonl drops them."""

    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        # check_sinks has said whether tensorboard is installed
        from torch.utils.tensorboard import (
            SummaryWriter,
        )

        purge = start_step + 1 if start_step else None
        self.writer = SummaryWriter(log_dir=str(RunFolder(run_dir).tensorboard), purge_step=purge)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run named after the run folder, with the run's config.toml (secrets are never in it); wandb's own
    settings apply (``WANDB_PROJECT``, ``WANDB_MODE=offline``)."""

    def __init__(self, run_dir: Path) -> None:
        import wandb  # check_sinks has said whether it is installed

        saved = RunFolder(run_dir).config
        config = load_toml(saved) if saved.is_file() else {}
        self.run = wandb.init(project="diloco", name=run_dir.name, dir=str(run_dir), config=config)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def check_sinks(log_to: Sequence[str]) -> None:
    """A ValueError naming the extra to install where a sink's library is missing (before the run starts)."""
    for name in log_to:
        if importlib.util.find_spec(name) is None:
            raise ValueError(
                f"train.log_to={list(log_to)} needs {name}, which is not installed: pip install 'diloco[{name}]'"
            )


def open_sinks(log_to: Sequence[str], *, run_dir: Path, start_step: int) -> list[Sink]:
    """The sinks ``log_to`` names, writing for the run in ``run_dir`` from ``start_step`` on (0, or a resume's)."""
    check_sinks(log_to)
    sinks: list[Sink] = []
    try:
        for name in log_to:
            sinks.append(
                TensorBoardSink(run_dir, start_step=start_step)
                if name == "tensorboard"
                else WandbSink(run_dir)
            )
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks

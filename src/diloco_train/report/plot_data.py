"""A run's curves as ``diloco plot`` draws them, read from its metrics.jsonl, on any of the x axes.

The x axes: ``step`` (per worker), ``bytes`` (what rank 0 had sent by then, cumulative: DDP's gradients every
step, DiLoCo's at round ends) and ``time`` (seconds of the training loop without its evaluations: an eval
record's ``eval_s`` is taken out of every later ``time_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..run_config import load_toml
from ..runs.run_folder import RunFolder
from .metrics import read_metrics

__all__ = ["AXES", "RunCurves", "read_run"]

AXES = ("step", "bytes", "time")
"""The x axes a run's curves can be drawn against."""


@dataclass(frozen=True)
class RunCurves:
    """One run's records, and where each of its steps lies on every x axis."""

    name: str
    """The run folder's name."""
    mode: str
    """train.mode of its config.toml (diloco, ddp, single; "" if the file is missing)."""
    transport: str
    """transport.kind of its config.toml ("" if unset or missing)."""
    train: list[tuple[int, float]]
    """(step, train loss) of each step record."""
    evals: list[tuple[int, float]]
    """(step, eval loss) of each eval record."""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    """The round records (``step``, ``num_contributors``, ``agreement``, ...)."""
    warm_start: int = 0
    """Steps of the DDP warm start before DiLoCo's first round (0: none)."""
    positions: dict[str, dict[int, float]] = field(default_factory=dict)
    """{axis: {step: x}} for the axes other than ``step``."""

    def x(self, axis: str, steps: list[int]) -> list[float]:
        """Where ``steps`` lie on ``axis`` (one of ``AXES``)."""
        if axis == "step":
            return [float(s) for s in steps]
        at = self.positions[axis]
        return [at.get(s, 0.0) for s in steps]

    @property
    def bytes_sent(self) -> float:
        """Bytes rank 0 sent in the whole run."""
        return max(self.positions["bytes"].values(), default=0.0)

    @property
    def contributors_vary(self) -> bool:
        """Whether the rounds had different numbers of contributors (peers that come and go)."""
        return len({r["num_contributors"] for r in self.rounds}) > 1


def read_run(run_dir: str | Path) -> RunCurves:
    """The curves of the run in ``run_dir`` (a ValueError if it holds no metrics.jsonl)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    saved = RunFolder(run_dir).config
    config = load_toml(saved) if saved.is_file() else {}
    steps = [r for r in records if r.get("type") == "step"]
    evals = [r for r in records if r.get("type") == "eval"]
    rounds = [r for r in records if r.get("type") == "round"]
    sent, eval_seconds = 0.0, 0.0
    at_bytes: dict[int, float] = {0: 0.0}
    at_time: dict[int, float] = {0: 0.0}
    # Records are in the order they happened: an eval's seconds count from the next record on.
    for r in records:
        if r.get("type") == "step":
            sent += r["bytes_sent"]
            at_bytes[r["step"]] = sent
            at_time[r["step"]] = r["time_s"] - eval_seconds
        elif r.get("type") == "eval":
            eval_seconds += r.get("eval_s", 0.0)
    return RunCurves(
        name=run_dir.resolve().name,
        mode=config.get("train", {}).get("mode", ""),
        transport=config.get("transport", {}).get("kind", ""),
        train=[(r["step"], r["loss"]) for r in steps],
        evals=[(r["step"], r["loss"]) for r in evals],
        rounds=rounds,
        warm_start=_warm_start(steps, rounds),
        positions={"bytes": at_bytes, "time": at_time},
    )


def _warm_start(steps: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> int:
    """The last step of a DiLoCo run's DDP warm start: its first steps each send gradients without ending an
    outer round (a run without rounds, DDP or one worker, has none)."""
    if not rounds:
        return 0
    ends = {r["step"] for r in rounds}
    warm = 0
    for r in steps:
        if r["bytes_sent"] == 0 or r["step"] in ends or r["step"] != warm + 1:
            break
        warm = r["step"]
    return warm

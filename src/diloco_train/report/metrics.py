"""A run's metrics.jsonl: rank 0 writes it (with the progress bar and the summary); ``runs.metrics_file`` reads it.

One JSON object per line, ``type`` one of step, round, eval, summary, each with the ``step`` it belongs to.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from diloco_core import RoundReport

from ..pace import Pace
from ..runs.metrics_file import read_metrics
from ..runs.run_folder import RunFolder
from .sinks import Sink, scalars_of

__all__ = ["Reporter", "TrainResult", "perplexity", "read_metrics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    """Where metrics.jsonl, config.toml, plot.png and checkpoints/ were written."""
    steps: int
    """Steps done per worker when the run stopped."""
    eval_before: float
    """Validation loss of the initial weights (from the first run of a resumed run)."""
    eval_after: float
    """Validation loss at the end."""
    wall_seconds: float
    """Seconds of the run's training loop (rank 0), summed over the invocations of a resumed run."""
    compute_seconds: float
    """Of which rank 0 computed (forward, backward, optimizer steps) rather than communicated."""
    bytes_sent: int
    """Bytes rank 0 put on the wire in the run (every invocation of a resumed one)."""
    steps_run: int = 0
    """Steps the records of metrics.jsonl cover: the run's, across resumes (``steps`` unless logs were lost); in
    an elastic run a round's work at once, as its records share the round's step."""
    rounds: int = 0
    """DiLoCo outer rounds in the run."""
    round_bytes: int = 0
    """Of ``bytes_sent``, what rank 0 sent in outer rounds (the rest: DDP steps of a warm start)."""
    goodput: float = 0.0
    """The workers' busy seconds over workers x wall (``pace.Pace``), of this process's workers; 0 where
    unknown (a resumed run's earlier invocations are not in it)."""
    rank0: bool = True
    """Whether this process ran rank 0, which reports the run; another process's result holds NaN losses."""


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(80) (NaN stays NaN)."""
    return math.exp(min(loss, 80.0))


class Reporter:
    """Rank 0's output: metrics.jsonl, the progress bar, the summary and the run's ``TrainResult``."""

    def __init__(
        self,
        *,
        run_dir: Path,
        world_size: int,
        start_step: int,
        end_step: int,
        show: bool,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.run_dir = run_dir
        self.sinks = sinks
        """Where the records go besides metrics.jsonl (``train.log_to``); closed with this."""
        # A resumed run's totals start from what its earlier invocations logged (up to the resume step).
        history = read_metrics(run_dir, missing_ok=True) if start_step else []
        steps = [r for r in history if r.get("type") == "step"]
        timed = [r["time_s"] for r in history if r.get("type") in ("step", "eval")]
        rounds = [r for r in history if r.get("type") == "round"]
        self.compute = sum(r["compute_s"] for r in steps)
        self.comm = sum(r["comm_s"] for r in steps)
        self.bytes_sent = sum(r["bytes_sent"] for r in steps)
        self.steps = 0
        """Steps the records cover (``TrainResult.steps_run``), earlier invocations' included."""
        self.last_step = 0
        for r in steps:
            self._advance(r["step"])
        self.last_step = (
            start_step  # records lost past the earlier ones up to the resume step do not count
        )
        self.rounds = len(rounds)
        self.round_bytes = sum(r["bytes_sent"] for r in rounds)
        self.offset = max(timed, default=0.0)
        """Seconds of training loop before this invocation (``time_s`` counts from the run's start, resumes
        included): its records' ``time_s`` continue from there."""
        self.started: float | None = None
        self.file: TextIO = RunFolder(run_dir).metrics.open("a", encoding="utf-8")
        self.contributors = world_size
        self.bar = None
        self._rate: float | None = None
        try:
            from tqdm import tqdm
        except ImportError:  # an optional extra: train without the bar rather than fail
            logger.warning("no progress bar: pip install 'diloco[train]'")
            show = False
        if show:
            self.bar = tqdm(
                total=end_step, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr
            )

    def start_clock(self) -> None:
        """The training loop starts now (after the first eval of a new run)."""
        self.started = time.perf_counter()

    def clock(self) -> float:
        """Seconds of the run's training loop so far, earlier invocations' included (0 before it started)."""
        return self.offset + (
            time.perf_counter() - self.started if self.started is not None else 0.0
        )

    def write(self, record: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        # a full disk: torch's or the OS's message alone would not say which file
        except OSError as e:
            raise OSError(f"cannot write {RunFolder(self.run_dir).metrics}: {e}") from None
        for sink in self.sinks:
            sink.log(record["step"], scalars_of(record))

    def _advance(self, step: int) -> int:
        """A record of ``step``: how far it moves the run past the newest record's step (one in lock-step; an
        elastic round's work where its round moved the step, as its records share the step)."""
        advance = max(0, step - self.last_step)
        self.last_step += advance
        self.steps += advance
        return advance

    def step(self, record: dict[str, Any]) -> None:
        self.compute += record["compute_s"]
        self.comm += record["comm_s"]
        self.bytes_sent += record["bytes_sent"]
        advance = self._advance(record["step"])
        rate = record["tokens_per_s"]
        self._rate = rate if self._rate is None else 0.9 * self._rate + 0.1 * rate
        self.write(record)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                tok_s=f"{self._rate:,.0f}",
                round=record["round"],
                workers=self.contributors,
                refresh=False,
            )
            # one in lock-step; an elastic round's work where its round moves the step (its last one may
            # go past train.steps: the bar keeps its total in sight)
            self.bar.total = max(self.bar.total, self.bar.n + advance)
            self.bar.update(advance)

    def round(self, step: int, report: RoundReport) -> None:
        self.contributors = report.num_contributors
        self.rounds += 1
        self.round_bytes += report.bytes_sent
        self.write(
            {
                "type": "round",
                "step": step,
                "round": report.round,
                "num_contributors": report.num_contributors,
                "bytes_sent": report.bytes_sent,
                "bytes_received": report.bytes_received,
                "comm_s": report.comm_seconds,
                "round_s": report.round_seconds,
                "pseudo_grad_norm": report.pseudo_grad_norm,
                "mean_pseudo_grad_norm": report.mean_pseudo_grad_norm,
                "agreement": report.agreement,
                "valid_contributors": report.valid_contributors,
                "excluded": report.excluded,
                "clipped": report.clipped,
                "mean_clipped": report.mean_clipped,
                "inner_steps": report.inner_steps,
                "work": report.work,
                "total_work": report.total_work,
                "absent": list(report.absent),
                "grace_s": report.grace_seconds,
                "left_out": [
                    {
                        "who": o.who,
                        "ratio": o.ratio if math.isfinite(o.ratio) else None,
                        "cosine": o.cosine,
                        "why": o.why,
                    }
                    for o in report.outliers
                ],
            }
        )

    def eval(self, step: int, loss: float, *, seconds: float) -> None:
        """Record an evaluation; ``seconds``: what it took, inside ``time_s`` (time to a loss leaves it out)."""
        record = {
            "type": "eval",
            "step": step,
            "loss": loss,
            "perplexity": perplexity(loss),
            "time_s": self.clock(),
        }
        self.write(record | {"eval_s": seconds})
        if self.bar is not None:
            self.bar.write(f"step {step}: eval loss {loss:.4f} (perplexity {perplexity(loss):.2f})")

    def finish(self, *, step: int, eval_after: float, busy: Sequence[float] = ()) -> TrainResult:
        """Write the summary record of the whole run (its wall: ``clock()``, earlier invocations' included), and
        return the run's result (its first eval, of a resumed run too, is read back). ``busy``: the busy seconds
        of this process's workers (``pace.Pace``), whose goodput the summary gives."""
        history = [r for r in read_metrics(self.run_dir) if r.get("type") == "eval"]
        before = history[0]["loss"] if history else math.nan
        wall = self.clock()
        goodput = Pace.goodput(busy, wall)
        self.write(
            {
                "type": "summary",
                "step": step,
                "wall_s": wall,
                "compute_s": self.compute,
                "comm_s": self.comm,
                "utilization": self.compute / wall if wall else 0.0,
                "goodput": goodput,
                "bytes_sent": self.bytes_sent,
                "eval_before": before,
                "eval_after": eval_after,
            }
        )
        return TrainResult(
            run_dir=self.run_dir,
            steps=step,
            eval_before=before,
            eval_after=eval_after,
            wall_seconds=wall,
            compute_seconds=self.compute,
            bytes_sent=self.bytes_sent,
            steps_run=self.steps,
            rounds=self.rounds,
            round_bytes=self.round_bytes,
            goodput=goodput,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        for sink in self.sinks:
            sink.close()

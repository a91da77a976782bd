"""Rank 0's report of a run: the steps its records cover, the bar, the summary's goodput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_train.report.metrics import Reporter
from diloco_train.report.run_words import run_header
from diloco_train.run_config import build_config


def _record(step: int) -> dict:
    return {
        "type": "step",
        "step": step,
        "round": 0,
        "loss": 1.0,
        "tokens_per_s": 1.0,
        "compute_s": 0.1,
        "comm_s": 0.0,
        "bytes_sent": 0,
        "time_s": 0.1 * step,
    }


@pytest.mark.parametrize(
    ("steps", "covered"),
    [
        ([1, 2, 3, 4], 4),  # lock-step: a record a step
        ([1, 2, 2, 2, 12, 12, 12, 22], 22),  # by time: a round's records share its step, which moves by its work
    ],
)
def test_the_bar_and_the_summary_count_the_runs_steps_not_rank_0s_records(
    tmp_path: Path, steps: list[int], covered: int
) -> None:
    report = Reporter(run_dir=tmp_path, world_size=2, start_step=0, end_step=20, show=True)
    try:
        report.start_clock()
        for step in steps:
            report.step(_record(step))
        assert report.bar is not None and report.bar.n == covered and report.bar.total == max(20, covered)
        result = report.finish(step=steps[-1], eval_after=1.0, busy=[0.5, 0.25])
    finally:
        report.close()
    assert result.steps_run == covered
    summary = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["type"] == "summary" and 0 < result.goodput == summary["goodput"]


def test_a_resumed_run_counts_what_its_earlier_records_covered(tmp_path: Path) -> None:
    first = Reporter(run_dir=tmp_path, world_size=2, start_step=0, end_step=40, show=False)
    for step in [1, 2, 2, 12, 12]:
        first.step(_record(step))
    first.close()
    again = Reporter(run_dir=tmp_path, world_size=2, start_step=12, end_step=40, show=False)
    try:
        for step in [12, 22, 22, 32]:
            again.step(_record(step))
        assert again.finish(step=32, eval_after=1.0).steps_run == 32
    finally:
        again.close()


@pytest.mark.parametrize(
    ("overrides", "fixed_ranks", "words"),
    [
        ([], True, "; its first 50 steps DDP (a warm start: gradients all-reduced every step, train.ddp_warm_start)"),
        (["train.ddp_warm_start=1"], True, "; its first step DDP (a warm start"),
        (["train.ddp_warm_start=0"], True, None),
        ([], False, None),  # peers come and go: no warm start by default
        (["train.mode=ddp"], True, None),
    ],
)
def test_the_header_names_the_ddp_warm_start_which_sends_every_step(
    overrides: list[str], fixed_ranks: bool, words: str | None
) -> None:
    line = run_header(build_config(overrides=overrides), Path("runs/r"), fixed_ranks=fixed_ranks)
    assert line.startswith("run runs/r: ") and "\n" not in line
    if words is None:
        assert "warm start" not in line
    else:
        assert words in line

"""The model a run produces: evals of the global weights at round boundaries, and ``diloco export`` loaded back
(ours and through transformers) giving the run's final eval loss."""

import json
from pathlib import Path

import pytest
from runs import FAST

from diloco_train.cli import main

# 13 steps with a round every 3: the last round ends at step 12, step 13 is one unsynced inner step after it.
ODD = [*FAST, "--set", "train.steps=13"]


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


@pytest.mark.timeout(60)
def test_evals_come_at_round_boundaries_when_eval_every_is_not_a_multiple_of_h(tmp_path: Path) -> None:
    args = ["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *ODD, "--set", "train.eval_every=2"]
    assert main(args) == 0
    # Asked for at 2, 4, ...: each comes at the round boundary at or after it; the last at the end of the run.
    evals = _records(tmp_path / "r", "eval")
    assert [r["step"] for r in evals] == [0, 3, 6, 9, 12, 13]
    # Step 13 is one unsynced inner step after the last round: its eval is of the same global weights.
    assert evals[-1]["loss"] == evals[-2]["loss"]

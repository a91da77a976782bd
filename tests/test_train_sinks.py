"""``train.log_to``: TensorBoard event files hold what metrics.jsonl holds; a missing extra is one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from runs import FAST

from diloco_train.cli import main
from diloco_train.report.metrics import read_metrics
from diloco_train.report.sinks import scalars_of
from diloco_train.runs.run_folder import RunFolder

pytestmark = pytest.mark.timeout(90)  # a FAST run (tests/runs.py, ~5 s here) and tensorboard's import


def test_tensorboard_files_hold_the_runs_train_and_eval_losses(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    args = ["train", "--name", "tb", "--set", f"train.runs_dir={tmp_path!s}", "--set", 'train.log_to=["tensorboard"]']
    assert main([*args, *FAST]) == 0
    run = tmp_path / "tb"
    records = read_metrics(run)
    events = event_accumulator.EventAccumulator(str(RunFolder(run).tensorboard))
    events.Reload()

    def logged(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    def written(kind: str, name: str) -> list[tuple[int, float]]:
        return [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in records if r["type"] == kind]

    assert len(logged("train/loss")) == 12 and logged("train/loss") == written("step", "loss")  # float32 in the file
    assert len(logged("eval/loss")) >= 2 and logged("eval/loss") == written("eval", "loss")
    assert logged("round/num_contributors") == [(s, 2.0) for s in (3, 6, 9, 12)]
    assert logged("summary/eval_after") == written("summary", "eval_after")
    assert "config.toml" in {p.name for p in run.iterdir()}  # the run itself is unchanged by its sink


def test_a_record_becomes_the_scalars_of_its_type() -> None:
    step = {"type": "step", "step": 3, "round": 1, "loss": 2.5, "lr": 1e-3, "bytes_sent": 10, "time_s": 1.5}
    assert scalars_of(step) == {"train/loss": 2.5, "train/lr": 1e-3, "train/bytes_sent": 10.0, "train/time_s": 1.5}
    assert scalars_of({"type": "eval", "step": 3, "loss": 2.0, "perplexity": 7.4}) == {
        "eval/loss": 2.0,
        "eval/perplexity": 7.4,
    }
    assert scalars_of({"type": "round", "step": 3, "num_contributors": 3, "absent": [1]}) == {
        "round/num_contributors": 3.0
    }


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_its_extra_is_one_line_before_the_run_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--name", "w", "--set", f"train.runs_dir={tmp_path!s}", "--set", 'train.log_to=["wandb"]']
    assert main([*args, *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the run's line, then the error
    assert err[1:] == [
        "diloco: error: train.log_to=['wandb'] needs wandb, which is not installed: pip install 'diloco[wandb]'"
    ]
    assert not (tmp_path / "w").exists()  # a failed start leaves no folder: a rerun may take the name


@pytest.mark.parametrize("value", ['["mlflow"]', '["tensorboard", "tensorboard"]', '"tensorboard"'])
def test_an_unknown_or_repeated_sink_is_refused_with_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert main(["train", "--set", f"train.runs_dir={tmp_path!s}", "--set", f"train.log_to={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diloco: error: ") and "log_to" in err[0]
    assert "a list of distinct names from ('tensorboard', 'wandb')" in err[0]

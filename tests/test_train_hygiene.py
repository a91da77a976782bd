"""The trainer's hygiene (issue 43, "What to build" 6): a torn last metrics line, bytes that are not UTF-8,
unsafe run names, failed starts, an out-of-range seed or quorum and a divergence before any checkpoint each
end in one line that names what to fix, or are handled."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from runs import FAST

from diloco_train import worker as worker_module
from diloco_train.cli import main


def _first_six(tmp_path: Path) -> tuple[list[str], Path]:
    """A run stopped after step 6 (its checkpoint written): the resume's arguments and its metrics.jsonl."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.stop_after=6"]) == 0
    return ["train", "--name", "r", "--resume", *common], tmp_path / "r" / "metrics.jsonl"


def _cut(data: bytes) -> bytes:
    return data[:-40]  # the summary record cut short, no newline: a crash or a full disk mid-write


def _junk(data: bytes) -> bytes:
    return data + b'{"type": "step", "st\x00\x00\xff\xfe'  # a torn write's tail: NULs, bytes not UTF-8


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tear", [_cut, _junk], ids=["cut", "junk"])
def test_a_torn_last_metrics_line_does_not_block_a_resume(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tear: Callable[[bytes], bytes],
) -> None:
    """Before: `diloco: error: .../metrics.jsonl:12 is not a JSON line` (exit 2), a good step-6 checkpoint."""
    resume, metrics = _first_six(tmp_path)
    metrics.write_bytes(tear(metrics.read_bytes()))
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        assert main(resume) == 0
    said = [r.getMessage() for r in caplog.records if str(metrics) in r.getMessage()]
    assert len(said) == 1 and "last line" in said[0] and "dropped" in said[0], said
    assert "resumed from step 6 of 12" in capsys.readouterr().err
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 13))
    assert [r["type"] for r in records].count("summary") == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bad", [b'{"type": "st', b"\xff\xfe"], ids=["cut", "not-utf8"])
def test_a_corrupt_metrics_line_before_the_last_still_blocks_a_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: bytes
) -> None:
    """Only the last line can be torn by a crash: a bad one before it is named (before: no file named for a
    byte that is not UTF-8), and the run folder is left as it was."""
    resume, metrics = _first_six(tmp_path)
    lines = metrics.read_bytes().split(b"\n")
    lines[3] = bad
    metrics.write_bytes(b"\n".join(lines))
    before = metrics.read_bytes()
    capsys.readouterr()
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"diloco: error: {metrics}:4 is not ") and len(err) == 2, err  # after "run ..."
    assert metrics.read_bytes() == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["config", "data"])
def test_bytes_that_are_not_utf8_are_refused_naming_their_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Before: `diloco: error: 'utf-8' codec can't decode byte 0xff in position 20: invalid start byte`."""
    bad = tmp_path / ("bad.toml" if where == "config" else "bad.jsonl")
    if where == "config":
        bad.write_bytes(b"[train]\nsteps = 5 # caf\xe9\n")  # Latin-1, not UTF-8
        args = ["--config", str(bad)]
    else:
        bad.write_bytes(b'{"text": "hello"}\n{"text": "caf\xe9"}\n')
        args = ["--set", f"data.path={bad!s}"]
    runs = tmp_path / "runs"
    assert main(["train", *args, "--set", f"train.runs_dir={runs!s}", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = f"{bad}:2" if where == "data" else repr(str(bad))
    assert err[-1].startswith("diloco: error: ") and line in err[-1] and "UTF-8" in err[-1], err


@pytest.mark.timeout(60)
def test_a_set_value_that_is_not_utf8_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command line's bytes that are not UTF-8 reach Python as surrogates. Before: `diloco: error: 'utf-8'
    codec can't encode character '\\udcff' in position 870: surrogates not allowed` (writing config.toml),
    with the run folder left behind."""
    runs = tmp_path / "r\udcff"
    assert main(["train", "--name", "n", "--set", f"train.runs_dir={runs!s}", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diloco: error: --set 'train.runs_dir="), err
    assert "UTF-8" in err[0] and "\\udcff" in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["a\nb", "a\x1b[31mred", "a b", "tab\t", "caf\u00e9", "-dash", "r\udcff"])
def test_a_run_name_outside_the_safe_characters_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Before: a newline, an escape sequence, a space (and so on) made the run folder's name."""
    assert main(["train", f"--name={name}", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"diloco: error: --name {name!r} is invalid: expected"), err
    assert "ASCII letters, digits, '.', '_' and '-'" in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_safe_run_name_is_taken_as_it_is(tmp_path: Path) -> None:
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", "train.steps=3"]
    assert main(["train", "--name", "Run_2.b-1", *common]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["Run_2.b-1"]


@pytest.mark.timeout(60)
def test_a_seed_out_of_range_names_the_key_and_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `diloco: error: Overflow when unpacking long long`, from the first worker, its folder made."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", "train.steps=3"]
    assert main(["train", "--set", "train.seed=99999999999999999999", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    valid = f"expected an integer in [0, {2**64 - 1}]"
    assert err == [f"diloco: error: [train] seed=99999999999999999999 is invalid: {valid}"], err
    assert list(tmp_path.iterdir()) == []
    # Every seed of the range runs: the largest too (each worker's data seed is derived from it).
    assert main(["train", "--name", "big", "--set", f"train.seed={2**64 - 1}", *common]) == 0


@pytest.mark.timeout(60)
def test_a_quorum_above_the_worker_count_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: accepted silently with 2 in-process workers (a round then waits for all, as quorum 0 does)."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", "train.steps=3"]
    assert main(["train", "--set", "transport.quorum=5", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    valid = "expected an integer in [0, 2] (0: every worker)"
    assert err == [f"diloco: error: transport.quorum=5 is invalid with train.workers=2: {valid}"], err
    assert list(tmp_path.iterdir()) == []
    assert main(["train", "--name", "q", "--set", "transport.quorum=2", *common]) == 0


@pytest.mark.timeout(60)
def test_a_divergence_before_any_checkpoint_points_at_no_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: `...; no checkpoint was written yet: resume from it with --resume and a lower train.lr`."""
    real = worker_module.loss_of

    def nan_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return real(model, x, y) * math.nan  # every step's: the run diverges at once, before step 3's checkpoint

    monkeypatch.setattr(worker_module, "loss_of", nan_loss)
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("diloco: error: training diverged: non-finite loss (nan) at 3 steps in a row"), err
    assert "no checkpoint was written yet" in err[-1] and "resume" not in err[-1], err
    assert "start a new run (another --name) with a lower train.lr (now 0.001)" in err[-1], err
    assert not (tmp_path / "r" / "checkpoints").exists()
    assert (tmp_path / "r" / "metrics.jsonl").stat().st_size > 0  # a failed run's records are kept
    # What it says to do works.
    monkeypatch.undo()
    assert main(["train", "--name", "r2", *common, "--set", "train.lr=0.0005"]) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("existed", [False, True], ids=["new", "existing"])
def test_a_failed_start_leaves_no_run_folder_it_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, existed: bool
) -> None:
    """Before: a start that failed once the folder was claimed (a worker's model, device or data) left it
    behind, with its lock files and config.toml. A folder that was there before is never removed."""

    def fails(*args: object, **kwargs: object) -> None:
        raise ValueError("the model cannot be built here")

    monkeypatch.setattr(worker_module, "Llama", fails)
    if existed:
        (tmp_path / "r").mkdir()
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "diloco: error: the model cannot be built here", err
    assert [p.name for p in tmp_path.iterdir()] == (["r"] if existed else [])


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: train.device=cuda starts")
def test_a_start_on_a_missing_device_leaves_no_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", "train.device=cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

"""Trusting the trainer (issue 13): a diverged run stops with a clear error and keeps its good checkpoints,
the summary is printed whatever the losses, a resume survives a corrupt checkpoint, and I/O or shape
problems end with one ``diloco: error:`` line."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from bitflip import flip_bit
from runs import FAST
from threads import in_threads

from diloco_train import worker as worker_module
from diloco_train.cli import main
from diloco_train.runs import checkpoint as ckpt
from diloco_train.runs.rank_files import RankFiles
from diloco_train.runs.run_folder import RunFolder


class Evil:
    """Any class: a checkpoint holding one is refused (loading it would unpickle it)."""


def _diverge_from(monkeypatch: pytest.MonkeyPatch, step: int, last: float = math.inf) -> None:
    """Every worker's loss (and so its gradients, then its weights) is NaN from its ``step``-th step on (to
    its ``last``-th)."""
    real = worker_module.loss_of
    calls = threading.local()

    def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.n = getattr(calls, "n", 0) + 1
        loss = real(model, x, y)
        return loss * math.nan if step <= calls.n <= last else loss

    monkeypatch.setattr(worker_module, "loss_of", loss_of)


def _checkpoints(run: Path) -> dict[str, bool]:
    """Each checkpoint file's name, and whether every tensor in it is finite."""

    def finite(obj: object) -> bool:
        if isinstance(obj, torch.Tensor):
            return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
        if isinstance(obj, dict):
            return all(finite(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return all(finite(v) for v in obj)
        return True

    folder = run / "checkpoints"
    return {p.name: finite(torch.load(p, weights_only=True)) for p in sorted(folder.glob("*.pt"))}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_a_run_that_ends_with_nan_losses_prints_its_summary_and_keeps_its_good_checkpoints(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """Before: exit 0 with an empty stdout (NaN read as "not rank 0"), and checkpoints 9 and 12, all NaN."""
    _diverge_from(monkeypatch, 7)
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", f"train.mode={mode}"]
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--name", "r", *common, "--set", "train.max_nonfinite_losses=100"]) == 0
    assert "-> nan (perplexity nan) after 12 steps" in capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if "not checkpointed" in r.getMessage()]
    assert warnings == [
        "step 9: the state holds NaN or infinite values: not checkpointed (the newest checkpoint is of step 6)"
    ]
    names = ["step00000003", "step00000006"]
    ranks = [0] if mode == "single" else [0, 1]
    assert _checkpoints(tmp_path / "r") == {f"{n}-rank{r}.pt": True for n in names for r in ranks}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_a_diverged_run_stops_after_max_nonfinite_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """Before: it trained on to step 12 with NaN weights and exited 0."""
    _diverge_from(monkeypatch, 7)
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", f"train.mode={mode}"]
    assert main(["train", "--name", "r", *common]) == 2  # the default: 3 in a row
    err = capsys.readouterr().err
    assert "non-finite loss (nan) at 3 steps in a row, steps 7 to 9 (train.max_nonfinite_losses=3)" in err
    assert "newest checkpoint is of step 6" in err and "Traceback" not in err
    assert all(_checkpoints(tmp_path / "r").values())
    # The run resumes from its last good checkpoint.
    monkeypatch.undo()
    assert main(["train", "--name", "r", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]) == 0
    assert "resumed from step 6 of 12" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_a_diverged_diloco_run_stops_with_finite_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the contribution guard, the core's refusal of the NaN pseudo-gradient ended it; now the round
    leaves both workers' contributions out and the trainer's own limit stops the run."""
    _diverge_from(monkeypatch, 7)
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 2
    err = capsys.readouterr().err
    assert "non-finite loss (nan) at 3 steps in a row" in err and "Traceback" not in err
    assert all(_checkpoints(tmp_path / "r").values())


@pytest.mark.timeout(90)
def test_a_diloco_worker_whose_training_diverged_once_is_left_out_of_the_round_and_trains_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One NaN loss (step 8): each worker's weights and moments become NaN; the round at step 9 leaves its
    pseudo-gradient out, every worker takes the global params, and the run ends well. Before: exit 2."""
    _diverge_from(monkeypatch, 8, last=8)
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST, "-q"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(r["step"], r["valid_contributors"], r["excluded"]) for r in rows if r["type"] == "round"]
    assert rounds == [(3, 2, False), (6, 2, False), (9, 0, True), (12, 2, False)], rounds
    assert math.isfinite(next(r for r in rows if r["type"] == "summary")["eval_after"])
    assert all(_checkpoints(tmp_path / "r").values())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("value", "shown"), [("0", "0"), ("-1", "-1"), ("1.5", "1.5"), ("true", "True")])
def test_max_nonfinite_losses_is_validated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, shown: str
) -> None:
    args = ["train", "--set", f"train.runs_dir={tmp_path!s}", "--set", f"train.max_nonfinite_losses={value}", "-q"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"[train] max_nonfinite_losses={shown} is invalid: expected an integer >= 1" in err


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"garbage")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("rank", "how"), [(0, "truncated"), (1, "garbage")])
def test_resume_falls_back_to_the_newest_intact_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, rank: int, how: str
) -> None:
    """Before: a traceback (rank 0's file, read to check the worker count) or an error (rank 1's)."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.stop_after=6"]) == 0
    bad = tmp_path / "r" / "checkpoints" / f"step00000006-rank{rank}.pt"
    _corrupt(bad, how)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--name", "r", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]) == 0
    err = capsys.readouterr().err
    assert "resumed from step 3 of 12" in err
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(bad) in w and "cannot be read" in w for w in warnings), warnings
    assert not any("weights_only" in w for w in warnings)


def _steps(run: Path) -> dict[int, list[int]]:
    """Each rank's checkpoint steps on disk."""
    return {r: RunFolder(run).rank(r).steps() for r in (0, 1)}


@pytest.mark.timeout(120)
def test_a_flipped_bit_is_refused_and_rotation_after_the_fallback_keeps_the_intact_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the flipped file loaded silently; and after a fallback from a corrupt step 6 to step 3, the next
    checkpoint (4) rotated out the intact 3 and kept the corrupt 6, the newest a later resume would try."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.stop_after=6"]) == 0
    run, folder = tmp_path / "r", tmp_path / "r" / "checkpoints"
    bad = folder / "step00000006-rank0.pt"
    flip_bit(bad)
    capsys.readouterr()
    resume = ["train", "--name", "r", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]
    with caplog.at_level(logging.WARNING):
        assert main([*resume, "--set", "train.stop_after=4"]) == 0
    assert "resumed from step 3 of 12, to step 4" in capsys.readouterr().err
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    refused = [w for w in warnings if str(bad) in w and "does not match its contents" in w]
    assert len(refused) == 1 and "\n" not in refused[0] and refused[0].endswith(": trying an older checkpoint")
    assert _steps(run) == {0: [3, 4], 1: [3, 4]}
    aside = sorted(p.name for p in folder.iterdir() if not p.name.endswith((".pt", ".json")))
    assert aside == ["step00000006-rank0.pt.corrupt", "step00000006-rank1.pt.unused"]  # rank 0 lacks step 6
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(resume) == 0  # from the intact 4, to the end, without a warning
    assert "resumed from step 4 of 12" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert _steps(run) == {0: [9, 12], 1: [9, 12]}


@pytest.mark.timeout(120)
def test_the_checkpoint_from_before_a_loss_spike_survives_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every worker's loss is 100 times itself from step 10 on. Its first spiking loss is computed on the state
    of step 9's checkpoint: step 6's is the newest before the spike, and rotation (keep 2) never deletes it.
    Before: steps 15 and 18 only."""
    real = worker_module.loss_of
    calls = threading.local()

    def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.n = getattr(calls, "n", 0) + 1
        return real(model, x, y) * (100.0 if calls.n >= 10 else 1.0)

    monkeypatch.setattr(worker_module, "loss_of", loss_of)
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", "train.steps=18"]
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--name", "r", *common]) == 0
    assert _steps(tmp_path / "r") == {0: [6, 15, 18], 1: [6, 15, 18]}
    spikes = sorted(r.getMessage() for r in caplog.records if "is a spike" in r.getMessage())
    assert len(spikes) == 2 and all(
        s.startswith("step 10: loss ") and "the checkpoint of step 6, the newest before it" in s for s in spikes
    )
    assert all(_checkpoints(tmp_path / "r").values())


@pytest.mark.timeout(60)
def test_no_readable_checkpoint_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.stop_after=6"]) == 0
    for p in (tmp_path / "r" / "checkpoints").glob("*-rank1.pt"):
        _corrupt(p, "garbage")
    capsys.readouterr()
    assert main(["train", "--name", "r", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]) == 2
    err = capsys.readouterr().err
    assert "diloco: error:" in err and "none of the checkpoints of worker(s) [1]" in err and "Traceback" not in err


def _save(folder: Path, step: int, rank: int, *, intact: bool) -> None:
    state = {"format": 1, "step": step, "core": {"w": torch.ones(3)}}
    RankFiles(folder, rank).save(step, state, keep=10)
    if not intact:
        _corrupt(RankFiles(folder, rank).checkpoint(step), "truncated")


@pytest.mark.timeout(60)
def test_ranks_agree_on_the_newest_step_that_is_intact_for_every_one(tmp_path: Path) -> None:
    """What in-process workers and torchrun ranks run: rank 0 lost step 9, rank 1 step 6; both resume from 3."""
    from diloco_train.runs.resume_from import resume_step
    from transports import transport_spec

    for step, broken in ((3, ()), (6, (1,)), (9, (0,))):
        for rank in (0, 1):
            _save(tmp_path / "checkpoints", step, rank, intact=rank not in broken)
    transports = transport_spec({}).connect(2)
    found: dict[int, int] = {}

    def pick(rank: int) -> None:
        found[rank] = resume_step(tmp_path, rank=rank, transport=transports[rank], timeout=30).step

    try:
        in_threads(pick, 2, timeout=50, what="ranks")
    finally:
        for t in transports:
            t.close()
    assert found == {0: 3, 1: 3}


@contextlib.contextmanager
def _tiny_disk(where: Path) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MB tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)


@pytest.mark.timeout(90)
def test_a_full_disk_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: torch's RuntimeError "unexpected pos" in a traceback, exit 1."""
    with _tiny_disk(tmp_path / "disk") as disk:
        assert main(["train", "--name", "r", "--set", f"train.runs_dir={disk!s}", *FAST]) == 2
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("diloco:")] == [
            line for line in err.splitlines() if "No space left on device" in line
        ]
        assert "diloco: error: cannot write checkpoint" in err and "Traceback" not in err
        assert not list((disk / "r" / "checkpoints").glob(".*.tmp"))


@pytest.mark.timeout(30)
def test_a_failed_write_names_the_file_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt.atomic_save({"step": 1}, tmp_path / "a.pt")
    real = functools.partial(os.fdopen, mode="wb")

    class Full:
        """The temp file on a disk that is full once 1000 bytes are written."""

        def __init__(self, fd: int) -> None:
            self.f, self.written = real(fd), 0

        def write(self, data: bytes) -> int:
            self.written += len(data)
            if self.written > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def flush(self) -> None:
            self.f.flush()

        def fileno(self) -> int:
            return self.f.fileno()

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    with pytest.raises(OSError, match=r"cannot write checkpoint .*a\.pt'?: \[Errno 28\] No space left on device"):
        ckpt.atomic_save({"step": 2, "w": torch.zeros(10_000)}, tmp_path / "a.pt", opener=Full)
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]
    assert ckpt.load_checkpoint(tmp_path / "a.pt")["step"] == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["single", "ddp", "diloco"])
@pytest.mark.parametrize("change", ["model.num_layers=2", "model.hidden_size=64"])
def test_a_resume_with_another_model_shape_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, change: str
) -> None:
    """Before (single, ddp): torch's RuntimeError from copying mismatched tensors, in a traceback, exit 1."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", f"train.mode={mode}"]
    assert main(["train", "--name", "r", *common, "--set", "train.stop_after=3"]) == 0
    capsys.readouterr()
    assert main(["train", "--name", "r", "--resume", *common, "--set", change]) == 2
    err = capsys.readouterr().err  # refused before anything is loaded: the change breaks exact resume
    key = change.split("=")[0]
    assert (
        err.startswith(f"diloco: error: --resume cannot continue the run exactly with {key} changed")
        and "--force" in err
    )
    assert main(["train", "--name", "r", "--resume", "--force", *common, "--set", change]) == 2
    err = capsys.readouterr().err  # forced: the checkpoint itself does not fit this model
    assert "diloco: error:" in err and "Traceback" not in err
    named = {
        "model.num_layers=2": "the checkpoint's model has 10 parameter tensors, this run's has 17",
        "model.hidden_size=64": "the checkpoint's model has embed.weight of shape (256, 128), this run's has (256, 64)",
    }
    assert (named[change] if mode != "diloco" else "DiLoCo state holds") in err  # the core's own message there


@pytest.mark.timeout(30)
def test_a_refused_file_does_not_echo_torchs_advice(tmp_path: Path) -> None:
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="cannot be read") as e:
        ckpt.load_checkpoint(tmp_path / "evil.pt")
    assert "weights_only" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_stray_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    """Before: only once the same rank wrote its next checkpoint (a resume at the end writes none)."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.stop_after=6"]) == 0
    folder = tmp_path / "r" / "checkpoints"
    strays = [folder / f".step00000009-rank{r}.pt.x1y2.tmp" for r in (0, 1)]
    for p in strays:
        p.write_bytes(b"half a checkpoint")
    assert main(["train", "--name", "r", "--resume", *common, "--set", "train.stop_after=6"]) == 0
    assert not any(p.exists() for p in strays)

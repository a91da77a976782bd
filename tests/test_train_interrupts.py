"""Stopping and restarting a run (issue 32): SIGINT and SIGTERM checkpoint before the trainer exits, also when
it was started with SIGINT ignored (a background job of a script); ``--resume`` merges ``--config``/``--set``
onto the saved config; run names stay inside runs_dir; torchrun with the in-process transport names the fix.

The signalled trainers are children started with SIGINT ignored, each bounded by a timeout and killed in a
``finally``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import FAST, losses

from diloco_train.cli import main

# Long enough that a signal lands mid-run; checkpoints only at the end, so one found is the interrupt's.
# (a later --set wins: these replace FAST's 12 steps and checkpoints every round)
_LONG = [*FAST, "--set", "train.steps=5000", "--set", "train.checkpoint_every=0"]


def _ignoring_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "diloco_train.cli", "train", "--set", f"train.runs_dir={str(tmp_path)!r}", *args]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignoring_sigint,  # noqa: PLW1509 - what a shell's background job inherits
    )


def _signal_after_steps(proc: subprocess.Popen[str], run: Path, *, steps: int, sig: int) -> str:
    """Send ``sig`` once ``run`` has logged ``steps`` steps; the child's stderr once it has ended."""
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count('"type": "step"') >= steps:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert metrics.is_file(), "the run logged no steps"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_the_step_reached_and_resume_continues_it_exactly(tmp_path: Path, sig: int) -> None:
    proc = _start(tmp_path, "--name", "cut", *_LONG)
    err = _signal_after_steps(proc, tmp_path / "cut", steps=7, sig=sig)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err
    ckpts = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir())
    assert len(ckpts) == 2 and ckpts[0].endswith("-rank0.pt") and ckpts[1].endswith("-rank1.pt"), ckpts
    step = int(ckpts[0][4:12])
    assert step >= 7 and ckpts[1] == f"step{step:08d}-rank1.pt"  # both workers stopped at one step
    hint = f"diloco train --resume --name cut --set 'train.runs_dir=\"{tmp_path}\"'"
    name = signal.Signals(sig).name
    assert err.strip().splitlines()[-1] == f"diloco: interrupted ({name}); newest checkpoint: step {step} " + (
        f"(resume with: {hint})"
    )
    # The interrupted run, resumed, continues as if it had never stopped (a few steps past the signal).
    until = ["--set", f"train.stop_after={step + 4}"]
    assert main(["train", "--name", "cut", "--resume", "--set", f"train.runs_dir={tmp_path!s}", *until, "-q"]) == 0
    assert main(["train", "--name", "whole", "--set", f"train.runs_dir={tmp_path!s}", *_LONG, *until]) == 0
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    assert len(losses(tmp_path / "whole")) == step + 4


@pytest.mark.timeout(120)
def test_a_signal_before_the_first_step_says_nothing_can_be_resumed(tmp_path: Path) -> None:
    # One worker whose first eval (before step 1) takes seconds: the signal lands before any step is begun.
    args = ["--name", "early", "-q", "--set", "train.mode=single", "--set", "train.eval_batches=4000", *_LONG]
    proc = _start(tmp_path, *args)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # "run ...: single, ...", printed before training starts
        assert first.startswith("run "), first + proc.communicate(timeout=60)[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "resume with" not in err
    assert err.strip().splitlines()[-1].endswith("nothing can be resumed"), err[-2000:]
    assert not list((tmp_path / "early").glob("checkpoints/*.pt"))


@pytest.mark.timeout(120)
def test_resume_with_config_merges_onto_the_saved_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--set", f"train.runs_dir={tmp_path!s}"]
    assert main(["train", "--name", "r", *common, *FAST, "--set", "train.stop_after=6"]) == 0
    saved = (tmp_path / "r" / "config.toml").read_text()
    capsys.readouterr()
    changes = tmp_path / "changes.toml"
    changes.write_text("[train]\neval_batches = 2\nstop_after = 9\n")
    assert main(["train", "--name", "r", "--resume", "--config", str(changes), *common, "-q"]) == 0
    err = capsys.readouterr().err
    assert "diloco: resume changes train.eval_batches: 1 -> 2" in err.splitlines()
    assert len(losses(tmp_path / "r")) == 9  # the saved 12 steps, stopped at 9: not the defaults' 600
    after = (tmp_path / "r" / "config.toml").read_text()
    assert after == saved.replace("eval_batches = 1", "eval_batches = 2")
    # A change that breaks exact resume is refused, naming the key, and nothing is run...
    assert main(["train", "--name", "r", "--resume", *common, "--set", "diloco.inner_steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco: error: --resume cannot continue the run exactly with diloco.inner_steps changed")
    assert "3 -> 4" in err and "--force" in err and len(losses(tmp_path / "r")) == 9
    # ...unless forced.
    assert main(["train", "--name", "r", "--resume", *common, "--set", "diloco.inner_steps=4", "--force"]) == 0
    assert "diloco: resume changes diloco.inner_steps: 3 -> 4" in capsys.readouterr().err
    assert len(losses(tmp_path / "r")) == 12 and "inner_steps = 4" in (tmp_path / "r" / "config.toml").read_text()


@pytest.mark.parametrize("name", ["../escape", "a/b", "a\\b", "", ".", "..", "absolute"])
def test_run_names_cannot_leave_runs_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    runs = tmp_path / "runs"
    name = str(tmp_path / "escape") if name == "absolute" else name
    assert main(["train", "--name", name, "--set", f"train.runs_dir={runs!s}", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"diloco: error: --name {name!r} is invalid: expected"), err
    assert not (tmp_path / "escape").exists() and not runs.exists()


def test_torchrun_with_the_in_process_transport_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets for its workers (RANK stays 0: this one speaks)
    assert main(["train", "--name", "t", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("diloco: error: [transport] kind='inprocess'") and "in use by process" not in err[-1]
    assert err[-1].endswith("add --set transport.kind=torch (docs/lan.md)")

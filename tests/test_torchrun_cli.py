"""``diloco torchrun``: torchrun's launcher ending in one line on Ctrl+C or a failed worker.

Before it, the documented one-machine command (``torchrun ... -m diloco_train.cli train``) printed two
chained ``SignalException`` tracebacks of torchrun's agent on Ctrl+C, and ~30 lines of
``ChildFailedError`` report after a worker's own one-line config error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
from runs import check_interrupted_line

from diloco_train.cli.torchrun import split_launcher_args

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "GLOO_SOCKET_IFNAME": "lo"}
LAUNCH = [sys.executable, "-m", "diloco_train.cli", "torchrun", "--standalone", "--nproc-per-node=2"]


def _train_args(tmp_path: Path, name: str, *more: str) -> list[str]:
    sets = [
        "transport.kind=torch",
        "model.num_layers=1",
        "train.eval_batches=1",
        "diloco.inner_steps=4",
        "train.checkpoint_every=1",
        f"train.runs_dir={str(tmp_path)!r}",
        *more,
    ]
    return ["train", "-q", "--name", name, *[a for s in sets for a in ("--set", s)]]


def test_the_launcher_options_and_the_train_command_are_split_at_train() -> None:
    assert split_launcher_args(["--standalone", "--nproc-per-node=2", "train", "--name", "a"]) == (
        ["--standalone", "--nproc-per-node=2"],
        ["train", "--name", "a"],
    )
    with pytest.raises(ValueError, match="needs the train command"):
        split_launcher_args(["--nproc-per-node=2"])
    with pytest.raises(ValueError, match="starts diloco_train.cli itself"):
        split_launcher_args(["--nproc-per-node=2", "-m", "diloco_train.cli", "train"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("when", ["after-a-checkpoint", pytest.param("mid-run", marks=pytest.mark.slow)])  # ~5 s each
def test_ctrl_c_under_diloco_torchrun_is_one_line(tmp_path: Path, when: str) -> None:
    """SIGINT to the launcher's process group, as a terminal's Ctrl+C sends it to torchrun and both workers."""
    name = f"ctrl-c-{when}"
    err = tmp_path / "err.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [*LAUNCH, *_train_args(tmp_path, name, "train.steps=5000")],
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=f,
            start_new_session=True,
        )
    try:
        run = tmp_path / name
        deadline = time.monotonic() + 150

        def ready() -> bool:
            if when == "after-a-checkpoint":
                # rank 0's: the one the interrupted line names (rank 1's may come first)
                return (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("*-rank0.pt"))
            metrics = run / "metrics.jsonl"
            return metrics.is_file() and metrics.read_text().count('"step"') >= 6

        while not ready():
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no progress within 150 s: {err.read_text()[-3000:]}"
            time.sleep(0.1)
        before = err.stat().st_size
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(90)
        left = procs.left_in_session(proc.pid, within=15)
    finally:
        procs.kill_session(proc)
    text = err.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert left == [], f"processes of the interrupted run still live: {left}"
    assert "Traceback" not in text, text[-3000:]
    after = err.read_bytes()[before:].decode().splitlines()
    # The workers stop at once (no soft stop across processes): the line names the newest checkpoint, if any
    # ("mid-run" is 3 steps in, but rank 0 may have checkpointed step 4 before the signal came).
    check_interrupted_line(
        after,
        run,
        resume=f"diloco torchrun --standalone --nproc-per-node=2 train --resume --name {name} ",
        may_have_none=when == "mid-run",
    )


@pytest.mark.timeout(120)
def test_a_failed_worker_ends_in_its_own_line_and_one_line_of_the_launcher(tmp_path: Path) -> None:
    out = subprocess.run(
        [*LAUNCH, *_train_args(tmp_path, "bad", "train.bogus=1")],
        check=False,
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()  # both ranks write to it: each message is one write (cli.main)
    assert lines[-1].startswith("diloco: error: worker rank ") and "exit status 2" in lines[-1], lines
    assert all(line.startswith("diloco: error: ") for line in lines), lines

"""The trainer as users meet it (issue 15): one owner per run folder, resume that covers the whole run and
changes nothing until it succeeds, messages that name what happened."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import FAST

from diloco_train.cli import main
from diloco_train.runs.ownership import RunOwner

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "diloco_train.cli", "train", *args]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)


@pytest.mark.timeout(60)
def test_a_live_owner_blocks_a_second_claim_and_a_dead_ones_lock_does_not(tmp_path: Path) -> None:
    code = "import sys; from pathlib import Path; from diloco_train.runs.ownership import RunOwner\n"
    code += "o = RunOwner(Path(sys.argv[1]), [0, 1]); print('owned', flush=True); sys.stdin.read()\n"
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "r")],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "owned"
        with pytest.raises(ValueError, match=f"is in use by process {child.pid} .*another --name"):
            RunOwner(tmp_path / "r", [1])
        RunOwner(tmp_path / "r", [2]).release()  # a rank it does not write is free
    finally:
        _stop(child)
    # The dead process's lock files (with its pid) are still there; they block nothing.
    assert (tmp_path / "r" / ".owner-rank0").read_text().strip() == str(child.pid)
    owner = RunOwner(tmp_path / "r", [0, 1])
    assert (tmp_path / "r" / ".owner-rank0").read_text().strip() == str(os.getpid())
    owner.release()


@pytest.mark.timeout(150)
def test_a_second_process_cannot_write_into_a_running_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the second process (here a --resume of the same name) trained into the folder, exit 0."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", "--set", "train.workers=2", "--set", "model.num_layers=1"]
    first = subprocess.Popen(
        _cli("--name", "same", "-q", *common, "--set", "train.steps=5000"),
        env=ENV,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        metrics = tmp_path / "same" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (not metrics.is_file() or '"step"' not in metrics.read_text()):
            time.sleep(0.2)
        assert metrics.is_file(), "the first run logged nothing"
        before = metrics.read_text()
        assert main(["train", "--name", "same", "--resume", *common]) == 2  # (FAST's changes would be refused)
        err = capsys.readouterr().err
        assert f"diloco: error: run '{tmp_path / 'same'}' is in use by process {first.pid}" in err
        assert "Traceback" not in err
        assert metrics.read_text().startswith(before)  # the first run's log, only ever appended to by it
    finally:
        _stop(first)


@pytest.mark.timeout(120)
def test_a_resumed_runs_summary_covers_the_whole_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the summary covered the last invocation only ("wall 0.5s, 0.0% utilization, 0.0 MB" for a
    finished run resumed again); nothing said where the run resumed, nor how to resume a stopped one."""
    common = ["--set", f"train.runs_dir={tmp_path!s}"]
    run = tmp_path / "r"
    assert main(["train", "--name", "r", *common, *FAST, "--set", "train.stop_after=6"]) == 0
    out = capsys.readouterr().out
    hint = f"resume with: diloco train --resume --name r --set 'train.runs_dir=\"{tmp_path}\"'"
    assert f"stopped at step 6 of 12 (train.stop_after); {hint}" in out
    first = [r["time_s"] for r in _records(run) if "time_s" in r]
    assert main(["train", "--name", "r", "--resume", *common, "-q"]) == 0
    captured = capsys.readouterr()
    assert f"run {run}: resumed from step 6 of 12, to step 12" in captured.err
    assert "stopped at step" not in captured.out
    records = _records(run)
    steps = [r for r in records if r["type"] == "step"]
    summary = records[-1]
    assert [r["type"] for r in records].count("summary") == 1 and summary["type"] == "summary"
    assert summary["bytes_sent"] == sum(r["bytes_sent"] for r in steps) > 0
    assert summary["compute_s"] == pytest.approx(sum(r["compute_s"] for r in steps))
    times = [r["time_s"] for r in records if "time_s" in r]
    assert times == sorted(times)  # the run's clock carries on across the resume: it counts both invocations
    assert times[: len(first)] == first and summary["wall_s"] >= times[-1]
    # Resuming the finished run again trains nothing and reports the same run.
    assert main(["train", "--name", "r", "--resume", *common, "-q"]) == 0
    again = _records(run)
    assert again[:-1] == records[:-1]
    assert again[-1]["bytes_sent"] == summary["bytes_sent"] and again[-1]["compute_s"] == summary["compute_s"]
    assert again[-1]["wall_s"] >= times[-1] and again[-1]["utilization"] > 0
    assert f"{summary['bytes_sent'] / 1e6:.1f} MB sent" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_mistyped_name_with_resume_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: once per worker."""
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--name", "typo", "--resume", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 0
    warnings = [r.getMessage() for r in caplog.records if "has no checkpoint yet" in r.getMessage()]
    assert warnings == [f"run {tmp_path / 'typo'} has no checkpoint yet: starting it from step 0"]


@pytest.mark.timeout(60)
def test_a_workers_missing_checkpoints_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "checkpointed with 1 worker(s) ... set train.workers=1", the wrong advice."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.stop_after=6"]) == 0
    for f in (tmp_path / "r" / "checkpoints").glob("*-rank1.pt"):
        f.unlink()
    capsys.readouterr()
    assert main(["train", "--name", "r", "--resume", *common]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint of worker(s) [1] of its 2" in err and "train.workers" not in err


@pytest.mark.timeout(60)
def test_a_failed_resume_changes_nothing_in_the_run_folder(tmp_path: Path) -> None:
    """Before: config.toml was overwritten with the failed attempt's and the summary line dropped."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.mode=ddp", "--set", "train.stop_after=3"]) == 0
    run = tmp_path / "r"
    before = {name: (run / name).read_bytes() for name in ("config.toml", "metrics.jsonl")}
    # Every worker finds a ddp checkpoint where it expects a diloco one.
    assert main(["train", "--name", "r", "--resume", *common, "--set", "train.mode=diloco"]) == 2
    assert {name: (run / name).read_bytes() for name in before} == before


@pytest.mark.timeout(120)
def test_verbose_round_lines_name_their_worker(tmp_path: Path) -> None:
    """Before: two identical-looking "round N" lines per round, no worker in either."""
    out = subprocess.run(
        _cli("--name", "v", "-v", "--set", f"train.runs_dir={str(tmp_path)!r}", *FAST),
        env=ENV,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = [line for line in out.stderr.splitlines() if "round 1:" in line]
    assert sorted(line.split("[", 1)[1].split("]", 1)[0] for line in rounds) == ["worker 0", "worker 1"]


@pytest.mark.timeout(60)
def test_a_port_in_use_is_said_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a traceback about failing to connect to bootstrap peers."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [
            "train",
            "--set",
            f"train.runs_dir={tmp_path!s}",
            "--set",
            "transport.kind=hivemind",
            "--set",
            f'transport.host_maddrs=["/ip4/127.0.0.1/tcp/{port}"]',
            "--set",
            "train.shard=0",
            "--set",
            "train.num_shards=2",
            "-q",
        ]
        assert main(args) == 2
    err = capsys.readouterr().err
    assert f"diloco: error: transport.host_maddrs: port {port} of '/ip4/127.0.0.1/tcp/{port}' is in use" in err


def test_the_join_command_runs_here_and_elsewhere_as_printed() -> None:
    from diloco_train.run_config import build_config
    from diloco_train.runs.join import join_command
    from transports import transport_spec

    sets = ["train.shard=0", "train.num_shards=4", "transport.kind=hivemind", 'transport.secret="s"']
    sets += [
        'transport.host_maddrs=["/ip4/0.0.0.0/tcp/31337"]',
        'transport.announce_maddrs=["/ip4/203.0.113.7/tcp/31337"]',
    ]
    config = build_config((), sets)
    spec = transport_spec(config.transport)
    out = join_command(config, spec=spec, run_name="wan", addresses=["/ip4/203.0.113.7/tcp/31337/p2p/Qm"])
    assert out == [
        "diloco",
        "train",
        "--name",
        "wan-shard1",
        "--set",
        "train.shard=1",
        "--set",
        "train.num_shards=4",
        "--set",
        'transport.kind="hivemind"',
        "--set",
        'transport.host_maddrs=["/ip4/0.0.0.0/tcp/0"]',
        "--set",
        "transport.announce_maddrs=[]",
        "--set",
        'transport.initial_peers=["/ip4/203.0.113.7/tcp/31337/p2p/Qm"]',
    ]
    # A secret never travels in the join command: this peer's is left out, and the file that print_join wrote
    # it to is named instead, once.
    generated = join_command(
        config,
        spec=spec,
        run_name="wan",
        addresses=["/ip4/203.0.113.7/tcp/31337/p2p/Qm"],
        settings={"secret_file": "/runs/wan/join.secret"},
    )
    assert generated == [*out[:-2], "--set", 'transport.secret_file="/runs/wan/join.secret"', *out[-2:]]


@pytest.mark.timeout(60)
def test_an_interrupted_run_names_its_resume_command(tmp_path: Path) -> None:
    from diloco_train.run_config import build_config
    from diloco_train.runs.run_name import resume_command

    config = build_config((), ["transport.kind=hivemind", 'transport.secret="x"', f"train.runs_dir={tmp_path!s}"])
    assert resume_command("r", config) == (
        f"diloco train --resume --name r --set 'train.runs_dir=\"{tmp_path}\"' --set 'transport.secret=\"...\"'"
    )
    assert resume_command("r", build_config((), [])) == "diloco train --resume --name r"
    # A run folder that holds the secret (join.secret, written when the join command was printed): the resume
    # reads it there, so the hint asks for nothing (it asked for the secret on the command line, visible in ps).
    stored = resume_command("r", config, secret_stored=True)
    assert stored == f"diloco train --resume --name r --set 'train.runs_dir=\"{tmp_path}\"'"


@pytest.mark.timeout(60)
def test_in_process_workers_save_the_shared_state_once(tmp_path: Path) -> None:
    """Before: every worker's file held the same global copy and outer momentum."""
    import torch

    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 0
    folder = tmp_path / "r" / "checkpoints"
    lead, other = (torch.load(folder / f"step00000012-rank{r}.pt", weights_only=True) for r in (0, 1))
    assert {"global", "outer_optimizer"} <= set(lead["core"])
    assert not {"global", "outer_optimizer"} & set(other["core"]) and other["from_rank0"] == [
        "global",
        "outer_optimizer",
    ]
    assert (folder / "step00000012-rank1.pt").stat().st_size < 0.7 * (folder / "step00000012-rank0.pt").stat().st_size

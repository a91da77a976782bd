"""`diloco train` as several processes: torchrun on the torch transport; replicas end identical."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
import torch
from test_overlap import TRAINER_MODES


@pytest.mark.slow  # ~12 s; torchrun jobs agree across ranks in test_torch_dist.py and test_torchrun_cli.py
@pytest.mark.timeout(240)
def test_torchrun_two_workers_end_with_identical_global_params(tmp_path):
    env = procs.loopback_env()
    cmd = procs.torchrun(
        "-m",
        "diloco_train.cli",
        "train",
        "--name",
        "lan",
        "-q",
        "--set",
        "transport.kind=torch",
        "--set",
        "train.steps=20",
        "--set",
        "diloco.inner_steps=10",
        "--set",
        "train.ddp_warm_start=0",  # two whole rounds (the restart test below runs the default warm start)
        "--set",
        "train.eval_batches=2",
        "--set",
        f"train.runs_dir={str(tmp_path)!r}",
    )
    out = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "one worker per process on torch" in out.stderr
    run = tmp_path / "lan"
    for name in ("metrics.jsonl", "config.toml", "plot.png"):
        assert (run / name).is_file()
    ranks = [torch.load(run / "checkpoints" / f"step00000020-rank{r}.pt", weights_only=True)["core"] for r in (0, 1)]
    assert ranks[0]["round"] == ranks[1]["round"] == 2
    assert torch.equal(ranks[0]["global"], ranks[1]["global"])


@pytest.mark.slow  # ~6 s of torchrun; the name rank 0 makes up is shared through the same rendezvous as test_torchrun_cli.py's
@pytest.mark.timeout(240)
def test_torchrun_ranks_without_a_name_share_rank_0s(tmp_path):
    """Each rank makes up a name from the time; ranks started in different seconds (made so here by
    clock_skew.py) used to split the run across two folders. Rank 0's name is the run's."""
    env = procs.loopback_env()
    cmd = procs.torchrun(str(Path(__file__).with_name("clock_skew.py")), "train", "-q", "--set", "transport.kind=torch")
    for key in ("train.steps=4", "diloco.inner_steps=2", "train.eval_batches=1", "model.num_layers=1"):
        cmd += ["--set", key]
    cmd += ["--set", f"train.runs_dir={str(tmp_path)!r}"]
    out = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(runs) == 1 and runs[0].name.startswith("diloco-") and runs[0].name.endswith("-0"), runs
    assert sorted(p.name for p in (runs[0] / "checkpoints").iterdir()) == [
        "step00000004-rank0.pt",
        "step00000004-rank1.pt",
    ]


@pytest.mark.slow  # ~35 s: with -m slow, to keep the default run under 10 minutes
@pytest.mark.timeout(240)
def test_two_hivemind_peers_on_loopback_end_with_identical_global_params(tmp_path):
    pytest.importorskip("hivemind")
    common = [
        "--set",
        "transport.kind=hivemind",
        "--set",
        'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        "--set",
        "transport.matchmaking_time=10.0",
        "--set",
        "transport.target_group_size=2",
        "--set",
        "transport.averaging_timeout=30.0",
        "--set",
        'transport.secret="test-secret"',
        "--set",
        "train.num_shards=2",
        "--set",
        "train.steps=20",
        "--set",
        "diloco.inner_steps=10",
        "--set",
        "train.eval_batches=2",
        "--set",
        "diloco.codec=fp16",
        "--set",
        f"train.runs_dir={str(tmp_path)!r}",
        "-q",
    ]
    cli = [sys.executable, "-m", "diloco_train.cli", "train"]
    with socket.socket() as probe:  # a fixed port, as on a machine behind a firewall (docs/wan.md)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fixed = ["--set", f'transport.host_maddrs=["/ip4/127.0.0.1/tcp/{port}"]']
    first = subprocess.Popen(
        cli + ["--name", "p1", "--set", "train.shard=0", *common, *fixed],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second = twin = None
    try:
        join = None
        for line in first.stderr:  # the first peer prints the command the others run
            if "transport.initial_peers=" in line:
                join = shlex.split(line)
                break
        assert join and join[:2] == ["diloco", "train"], "the first peer printed no join command"
        # The same name again, while the first peer runs: refused before it joins anything.
        twin = subprocess.Popen(
            cli + ["--name", "p1", "--set", "train.shard=1", *common, *fixed],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The printed command, pasted as is on this machine: its own name, shard and a free port.
        second = subprocess.run(cli + join[2:], check=False, cwd=tmp_path, capture_output=True, text=True, timeout=200)
        _, twin_err = twin.communicate(timeout=60)
        assert second.returncode == 0, second.stderr[-3000:]
        assert first.wait(timeout=60) == 0
        assert twin.returncode == 2 and f"is in use by process {first.pid}" in twin_err, twin_err[-2000:]
    finally:
        for proc in (first, twin):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    cores = [
        torch.load(tmp_path / p / "checkpoints" / "step00000020-rank0.pt", weights_only=True)["core"]
        for p in ("p1", "p1-shard1")
    ]
    assert cores[0]["round"] == cores[1]["round"] == 2
    assert torch.equal(cores[0]["global"], cores[1]["global"])
    assert "secret" not in (tmp_path / "p1" / "config.toml").read_text()
    rounds = [json.loads(line) for line in (tmp_path / "p1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_contributors"] for r in rounds if r["type"] == "round"] == [2, 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "overlap",
    # all slow (~32 s each): the default run was over its 10 minutes; resuming after a crash is covered there by
    # test_train_cli's restart-before-the-first-checkpoint case and the checkpoint tests
    [pytest.param(mode, marks=pytest.mark.slow) for mode in ("none", "eager", "streaming")],
)
def test_torchrun_restarts_a_killed_worker_and_the_run_resumes_to_the_end(tmp_path, overlap):
    """The kill lands after the step-20 checkpoint: with overlap, while a reduce is in flight (eager's round,
    streaming's fragments); the survivor's wait fails, torchrun restarts both and they resume alike."""
    env = procs.loopback_env()
    cmd = procs.torchrun(
        "-m",
        "diloco_train.cli",
        "train",
        "--name",
        "lan",
        "--resume",
        "-q",
        "--set",
        "transport.kind=torch",
        "--set",
        "transport.timeout=20.0",
        "--set",
        "diloco.reduce_timeout=20.0",
        "--set",
        "train.steps=60",
        "--set",
        "diloco.inner_steps=10",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.checkpoint_every=1",
        "--set",
        f"train.runs_dir={str(tmp_path)!r}",
        *TRAINER_MODES[overlap],
        max_restarts=1,
    )
    agent = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ckpt = tmp_path / "lan" / "checkpoints"
        deadline = time.monotonic() + 150
        while not (ckpt / "step00000020-rank1.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (ckpt / "step00000020-rank1.pt").exists(), "no checkpoint appeared"
        workers = [p for p in procs.children(agent.pid) if b"diloco_train" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # a node dies mid-run
        _, err = agent.communicate(timeout=200)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, err[-3000:]
    cores = [torch.load(ckpt / f"step00000060-rank{r}.pt", weights_only=True)["core"] for r in (0, 1)]
    # the default warm start: 60 // 12 = 5 DDP steps, then 5 rounds of 10 (the last 5 inner steps end no round)
    assert cores[0]["round"] == cores[1]["round"] == (5 if overlap != "streaming" else 11)
    assert torch.equal(cores[0]["global"], cores[1]["global"])
    if overlap == "eager":  # flushed at the end: every worker's model is the consensus global copy
        assert all(torch.equal(a, b) for a, b in zip(cores[0]["model"], cores[1]["model"]))
    rows = [json.loads(line) for line in (tmp_path / "lan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["type"] == "step"] == list(range(1, 61))  # nothing logged twice

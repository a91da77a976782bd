"""`diloco train` as several processes: torchrun on the torch transport; replicas end identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
import torch


@pytest.mark.timeout(240)
def test_torchrun_two_workers_end_with_identical_global_params(tmp_path):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
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
        "train.eval_batches=2",
        "--set",
        f"train.runs_dir={str(tmp_path)!r}",
    ]
    out = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "one worker per process on torch" in out.stderr
    run = tmp_path / "lan"
    for name in ("metrics.jsonl", "config.toml", "plot.png"):
        assert (run / name).is_file()
    ranks = [torch.load(run / "checkpoints" / f"step00000020-rank{r}.pt", weights_only=True)["core"] for r in (0, 1)]
    assert ranks[0]["round"] == ranks[1]["round"] == 2
    assert torch.equal(ranks[0]["global"], ranks[1]["global"])


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
        "diloco.wire_dtype=fp16",
        "--set",
        f"train.runs_dir={str(tmp_path)!r}",
        "-q",
    ]
    cli = [sys.executable, "-m", "diloco_train.cli", "train"]
    first = subprocess.Popen(
        cli + ["--name", "p1", "--set", "train.shard=0", *common],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second = None
    try:
        join = None
        for line in first.stderr:  # the first peer prints the command the others run
            if "transport.initial_peers=" in line:
                join = line.split("transport.initial_peers=", 1)[1].strip().strip("'")
                assert line.strip().startswith("diloco train ")
                break
        assert join, "the first peer printed no join command"
        second = subprocess.run(
            cli + ["--name", "p2", "--set", "train.shard=1", "--set", f"transport.initial_peers={join}", *common],
            check=False,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert second.returncode == 0, second.stderr[-3000:]
        assert first.wait(timeout=60) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    cores = [
        torch.load(tmp_path / p / "checkpoints" / "step00000020-rank0.pt", weights_only=True)["core"]
        for p in ("p1", "p2")
    ]
    assert cores[0]["round"] == cores[1]["round"] == 2
    assert torch.equal(cores[0]["global"], cores[1]["global"])
    assert "secret" not in (tmp_path / "p1" / "config.toml").read_text()
    rounds = [json.loads(line) for line in (tmp_path / "p1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_contributors"] for r in rounds if r["type"] == "round"] == [2, 2]


@pytest.mark.timeout(300)
def test_torchrun_restarts_a_killed_worker_and_the_run_resumes_to_the_end(tmp_path):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
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
    ]
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
    assert cores[0]["round"] == cores[1]["round"] == 6
    assert torch.equal(cores[0]["global"], cores[1]["global"])
    rows = [json.loads(line) for line in (tmp_path / "lan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["type"] == "step"] == list(range(1, 61))  # nothing logged twice

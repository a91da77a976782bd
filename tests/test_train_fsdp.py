"""`diloco train --set train.fsdp_shards=N` under torchrun: islands of N FSDP2 ranks, a killed rank resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import procs
import pytest
import torch
import torch.distributed.tensor  # loading the checkpoints' DTensors (the inner optimizer's) needs it imported

from diloco_train.launch import train
from diloco_train.run_config import build_config
from diloco_train.train_config import TrainConfig


@pytest.mark.slow  # about 56 s: with -m slow; tests/test_fsdp_islands.py covers the bit-exact resume by default
@pytest.mark.timeout(400)
def test_torchrun_islands_of_two_fsdp_ranks_restart_a_killed_rank_and_resume_to_the_end(tmp_path):
    env = procs.loopback_env()
    sets = {
        "transport.kind": "'torch'",
        "transport.timeout": "30.0",
        "diloco.reduce_timeout": "30.0",
        "train.fsdp_shards": "2",
        "train.steps": "40",
        "diloco.inner_steps": "10",
        "diloco.codec": "'fp32'",  # the bytes below are fp32 shards
        "train.eval_batches": "2",
        "train.checkpoint_every": "1",
        "train.runs_dir": repr(str(tmp_path)),
    }
    cmd = procs.torchrun("-m", "diloco_train.cli", "train", "--name", "isl", "--resume", "-q", nproc=4, max_restarts=1)
    cmd += [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    agent = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ckpt = tmp_path / "isl" / "checkpoints"
        deadline = time.monotonic() + 200
        while not (ckpt / "step00000020-rank3.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (ckpt / "step00000020-rank3.pt").exists(), "no checkpoint appeared"
        workers = [p for p in procs.children(agent.pid) if b"diloco_train" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 4, workers
        os.kill(workers[3], signal.SIGKILL)  # a rank of island 1 dies mid-run
        _, err = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, err[-3000:]
    assert "exitcode: -9" in err, err[-3000:]  # the rank was killed; torchrun restarted all 4, which ended well
    cores = [torch.load(ckpt / f"step00000040-rank{r}.pt", weights_only=True)["core"] for r in range(4)]
    assert [c["round"] for c in cores] == [4] * 4
    # ranks 0 and 2 hold shard 0 in islands 0 and 1, ranks 1 and 3 shard 1: each pair agrees bit for bit
    assert torch.equal(cores[0]["global"], cores[2]["global"]) and torch.equal(cores[1]["global"], cores[3]["global"])
    assert not torch.equal(cores[0]["global"][:100], cores[1]["global"][:100])  # different shards
    rows = [json.loads(line) for line in (tmp_path / "isl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["type"] == "step"] == list(range(1, 41))  # nothing logged twice
    rounds = [r for r in rows if r["type"] == "round"]
    numel = sum(c["global"].numel() for c in cores[:2])  # the whole model, over the island's 2 ranks
    assert [r["bytes_sent"] for r in rounds] == [
        4 * (cores[0]["global"].numel() + 5)
    ] * 4  # a shard's (+ flag, work, digest, its square, RMS)
    assert cores[0]["global"].numel() < numel


def test_fsdp_shards_is_refused_outside_diloco_mode_and_the_torch_transport(tmp_path):
    with pytest.raises(ValueError, match="fsdp_shards"):
        TrainConfig(mode="ddp", fsdp_shards=2)
    with pytest.raises(ValueError, match="fsdp_shards"):
        TrainConfig(fsdp_shards=2, ddp_warm_start=5, steps=10)
    with pytest.raises(ValueError, match="fsdp_shards"):
        TrainConfig(fsdp_shards=0)
    config = build_config(overrides=["train.fsdp_shards=2", "train.workers=2"])
    with pytest.raises(ValueError, match="needs \\[transport\\] kind='torch' under torchrun, not kind='inprocess'"):
        train(config, tmp_path / "run", show_progress=False)

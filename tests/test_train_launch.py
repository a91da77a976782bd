"""`diloco train` as several processes: torchrun on the torch transport; replicas end identical."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.timeout(240)
def test_torchrun_two_workers_end_with_identical_global_params(tmp_path):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "diloco_train.cli", "train", "--name", "lan", "-q", "--set", "transport.kind=torch",
           "--set", "train.steps=20", "--set", "diloco.inner_steps=10", "--set", "train.eval_batches=2",
           "--set", f"train.runs_dir={str(tmp_path)!r}"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "one worker per process on torch" in out.stderr
    run = tmp_path / "lan"
    for name in ("metrics.jsonl", "config.toml", "plot.png"):
        assert (run / name).is_file()
    ranks = [torch.load(run / "checkpoints" / f"step00000020-rank{r}.pt", weights_only=True)["core"] for r in (0, 1)]
    assert ranks[0]["round"] == ranks[1]["round"] == 2
    assert torch.equal(ranks[0]["global"], ranks[1]["global"])

"""Every shell command of docs/trainer.md, lan.md and wan.md that can run on one machine runs as written,
with small step counts appended (later ``--set`` wins), so the docs cannot drift from the CLI.

The in-process commands run by default; torchrun, hivemind and the bare default run are ``slow``. A
command that cannot run here is skipped for a stated reason; a new command matches a reason or runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
SRC = Path(__file__).resolve().parents[1] / "src"

SKIP = {
    "pip install": "installs packages",
    "python -m pytest": "the tests themselves",
    "NODE0_IP": "needs N machines",
    "HOST:29500": "needs two machines",
    "/p2p/": "joins a peer by an example address",
}
SLOW = ("torchrun", "transport.kind=hivemind")

# Appended to every `diloco train`: a handful of steps of a 1-layer model (later --set wins).
SMALL = (
    "--set train.steps=6 --set diloco.inner_steps=3 --set model.num_layers=1 --set data.seq_len=32 "
    "--set train.batch_size=4 --set train.eval_batches=1 --set train.warmup_steps=1 -q"
)
HIVEMIND = "--set transport.matchmaking_time=0.5 --set transport.averaging_timeout=10.0"
PRELUDE = f"""
set -euo pipefail
diloco() {{
  if [ "$#" -eq 0 ]; then set -- train; fi
  if [ "$1" = train ] || [ "$1" = torchrun ]; then
    case "$*" in *kind=hivemind*) set -- "$@" {HIVEMIND};; esac
    {sys.executable} -m diloco_train.cli "$@" {SMALL}
  else
    {sys.executable} -m diloco_train.cli "$@"
  fi
}}
torchrun() {{ {sys.executable} -m torch.distributed.run "$@" {SMALL}; }}
"""


def commands(doc: str) -> list[str]:
    """The doc's shell commands in order, continuation lines joined, comment lines dropped."""
    out = []
    text = (DOCS / doc).read_text(encoding="utf-8")
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.DOTALL):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip() and not command.strip().startswith("#"):
                out.append(command.strip())
    return out


def _skipped(command: str) -> bool:
    return any(marker in command for marker in SKIP)


def _slow(command: str) -> bool:
    return any(marker in command for marker in SLOW) or command.split("#")[0].strip() == "diloco"


def _run(tmp_path: Path, doc: str, picked: list[str], timeout: float) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    for command in picked:
        out = subprocess.run(
            ["bash", "-c", PRELUDE + command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert out.returncode == 0, f"{doc}: {command}\n{out.stderr[-3000:]}"


def test_every_docs_command_is_run_or_skipped_for_a_reason() -> None:
    found = {doc: commands(doc) for doc in ("trainer.md", "lan.md", "wan.md")}
    assert sum(len(c) for c in found.values()) >= 15
    assert any(not _skipped(c) and not _slow(c) for c in found["trainer.md"])
    assert any(not _skipped(c) and _slow(c) for c in found["lan.md"] + found["wan.md"])


@pytest.mark.slow  # ~48 s, 16 processes: with -m slow, as test_every_command_that_runs_on_one_machine_runs[trainer.md] (the default run was 12 minutes)
@pytest.mark.timeout(600)
def test_the_in_process_commands_of_the_trainer_doc_run(tmp_path: Path) -> None:
    picked = [c for c in commands("trainer.md") if not _skipped(c) and not _slow(c)]
    _run(tmp_path, "trainer.md", picked, timeout=120)
    assert (tmp_path / "runs" / "compare.png").is_file() and (tmp_path / "runs" / "long" / "plot.png").is_file()


@pytest.mark.slow  # ~21 s: the default run was over its 10 minutes; tests/test_elastic.py covers the features
@pytest.mark.timeout(300)
def test_the_commands_of_the_elastic_doc_run(tmp_path: Path) -> None:
    picked = [c for c in commands("elastic.md") if not _skipped(c) and not _slow(c)]
    assert len(picked) == 4
    # rounds of half a second instead of the doc's 5 (the later --set wins, as SMALL's sizes do)
    fast = [f"{c} --set diloco.round_seconds=0.5" if "round_seconds" in c else c for c in picked]
    _run(tmp_path, "elastic.md", fast, timeout=120)
    assert (tmp_path / "runs" / "elastic.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("doc", ["trainer.md", "lan.md", "wan.md"])
def test_every_command_that_runs_on_one_machine_runs(tmp_path: Path, doc: str) -> None:
    _run(tmp_path, doc, [c for c in commands(doc) if not _skipped(c)], timeout=400)

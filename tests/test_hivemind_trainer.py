"""`diloco train` peers on the hivemind transport: Ctrl+C, and (slow) a peer that joins a swarm already going.

Every peer runs as `python -m diloco_train.cli` in a session of its own, so that a test can send SIGINT to
its whole process group, as a terminal's Ctrl+C does (the peer, its DHT and averager processes, and p2pd).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
from runs import check_interrupted_line

pytest.importorskip("hivemind")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
CLI = [sys.executable, "-m", "diloco_train.cli", "train", "-q"]


def _peer_args(tmp_path: Path, name: str, *more: str) -> list[str]:
    sets = [
        "transport.kind=hivemind",
        'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        'transport.secret="t"',
        "transport.matchmaking_time=2.0",
        "transport.averaging_timeout=20.0",
        "train.num_shards=2",
        "train.shard=0",
        "model.num_layers=1",
        "train.eval_batches=1",
        f"train.runs_dir={str(tmp_path)!r}",
        *more,
    ]
    return [*CLI, "--name", name, *[a for s in sets for a in ("--set", s)]]


def _start(argv: list[str], cwd: Path, err: Path, env: dict | None = None) -> subprocess.Popen:
    with open(err, "w") as f:
        return subprocess.Popen(
            argv, cwd=cwd, env=env or ENV, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True
        )


def _stale_sockets() -> set[Path]:
    """hivemind's socket files (its p2p daemon's and clients': always under /tmp, whatever TMPDIR says) that no
    live process has bound (/proc/net/unix lists the bound ones)."""
    bound = {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:] if len(line.split()) > 7}
    return {p for p in Path("/tmp").glob("hivemind-*.sock") if str(p) not in bound}


def _wait_for(what: str, ok, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert proc.poll() is None, f"the peer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s"
        time.sleep(0.1)


def _steps(metrics: Path) -> int:
    return metrics.read_text().count('"type": "step"') if metrics.is_file() else 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "when", [pytest.param("after-a-checkpoint", marks=pytest.mark.slow), "in-a-round"]
)  # ~4 s each
def test_ctrl_c_on_a_hivemind_peer_is_one_line(tmp_path: Path, when: str) -> None:
    """SIGINT to the peer's process group (a terminal's Ctrl+C reaches p2pd and every child too). Before:
    p2pd shut down on it, the averagers failed to close through it and printed ~150 lines of tracebacks,
    and hivemind logged an ERROR with a traceback for every round that found no group."""
    name = f"ctrl-c-{when}"
    run = tmp_path / name
    argv = _peer_args(tmp_path, name, "train.steps=5000", "diloco.inner_steps=4", "train.checkpoint_every=4")
    err = tmp_path / "peer.err"
    tmp = tmp_path / "tmp"  # the peer's temporary folders: multiprocessing's pymp-* is counted after
    tmp.mkdir()
    sockets = _stale_sockets()
    proc = _start(argv, tmp_path, err, env={**ENV, "TMPDIR": str(tmp)})
    try:
        if when == "after-a-checkpoint":
            ckpt = run / "checkpoints"
            _wait_for("checkpoint", lambda: ckpt.is_dir() and any(ckpt.glob("*.pt")), 180, proc)
        else:  # a lone peer's rounds: the state check and commit, past round 1
            _wait_for("second round", lambda: _steps(run / "metrics.jsonl") >= 6, 180, proc)
        before = err.stat().st_size  # what the run printed so far (the join command, warnings)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        left = procs.left_in_session(proc.pid, within=15)
    finally:
        procs.kill_session(proc)
    text = err.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert left == [], f"processes of the interrupted peer still run: {left}"
    assert list(tmp.glob("pymp-*")) == [], "the interrupted peer left multiprocessing's folder behind"
    assert _stale_sockets() - sockets == set(), "the interrupted peer left socket files behind"
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    after = err.read_bytes()[before:].decode().splitlines()
    # A peer stops at once (no soft stop across processes): the line names its newest checkpoint, if any.
    check_interrupted_line(
        after, run, resume=f"diloco train --resume --name {name} ", may_have_none=when == "in-a-round"
    )


def _join_addresses(err: Path) -> list[str] | None:
    for line in err.read_text().splitlines():
        if "transport.initial_peers=" in line:
            for arg in shlex.split(line):
                if arg.startswith("transport.initial_peers="):
                    return json.loads(arg.split("=", 1)[1])
    return None


def _rounds(metrics: Path) -> list[dict]:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return [r for r in map(json.loads, lines) if r["type"] == "round"]


def _step_records(metrics: Path) -> list[int]:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return [r["step"] for r in map(json.loads, lines) if r["type"] == "step"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_peer_started_a_minute_later_averages_with_the_swarm_from_its_first_round(tmp_path: Path) -> None:
    """Before: the joiner's start-up check waited 2 x matchmaking_time alone, its rounds and the swarm's
    were out of phase, and every round of both averaged alone (1 contributor). And (issue 45, item 7) it
    counted steps from its own 0, so one round was at different steps in the two peers' logs."""
    gap = float(os.environ.get("DILOCO_JOIN_GAP", "45"))  # 100 for the figure (docs/wan.md)
    mm = ["transport.matchmaking_time=5.0", "diloco.inner_steps=10", "train.steps=100000"]  # the run's length
    first_err, late_err = tmp_path / "first.err", tmp_path / "late.err"
    first = _start(_peer_args(tmp_path, "first", *mm), tmp_path, first_err)
    late = None
    try:
        _wait_for("join command", lambda: _join_addresses(first_err) is not None, 120, first)
        addresses = _join_addresses(first_err)
        time.sleep(gap)  # the first peer trains alone meanwhile
        was_at = max(_step_records(tmp_path / "first" / "metrics.jsonl"), default=0)
        # The joiner takes the run's step from the swarm's state, past was_at by the rounds of its start-up
        # (8 to 11 here: lone rounds are short), and stops 60 rounds after was_at: many rounds with the swarm.
        stop = (was_at // 10 + 60) * 10
        join = [f"transport.initial_peers={json.dumps(addresses)}", "train.shard=1", f"train.stop_after={stop}"]
        late = _start(_peer_args(tmp_path, "late", *mm, *join), tmp_path, late_err)
        assert late.wait(400) == 0, late_err.read_text()[-3000:]
    finally:
        for proc in (first, late):
            if proc is not None:
                procs.kill_session(proc)
    rounds = _rounds(tmp_path / "late" / "metrics.jsonl")
    steps = _step_records(tmp_path / "late" / "metrics.jsonl")
    assert len(rounds) >= 4 and [r["num_contributors"] for r in rounds] == [2] * len(rounds), rounds
    joined = steps[0] - 1  # the swarm's step at the join: a round's end
    assert was_at < joined and joined % 10 == 0 and steps == list(range(joined + 1, stop + 1)), steps
    swarm = {r["round"]: r["step"] for r in _rounds(tmp_path / "first" / "metrics.jsonl")}
    assert [(r["round"], r["step"]) for r in rounds] == [(r["round"], swarm[r["round"]]) for r in rounds]
    print(
        f"joined {gap:g}s later at step {joined} (the first peer at {was_at} when it started), "
        f"{len(rounds)} rounds, round times {sorted(round(r['comm_s'], 2) for r in rounds)[-5:]} s at most"
    )

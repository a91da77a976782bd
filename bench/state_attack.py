"""A served state with a fake tag (issue 44, item 3): hivemind peers as processes on 127.0.0.1, one
of them an insider that, from its round ``--at`` on, fills its global params with noise and serves
them under the tag of round 10^6 (through the transport's public ``load_state_dict``, as a resumed
checkpoint would), every round.

Two cases, each against its honest baseline (the same peers, same shards and ``train.workers``, no
insider):

- ``pair``: a veteran and the insider, a swarm of two (a meeting of one against one); baseline:
  the veteran alone.
- ``joiner``: two honest peers and the insider from the start, a fresh joiner once the first peer
  has committed ``--join-after`` rounds; baseline: the three honest peers, the joiner at the same
  point.

Reported per honest peer: exit code, final eval loss against the baseline's, and the first line of
its log that names the insider. Not part of the test run.

    python bench/state_attack.py --out runs/state-attack            # both cases, 200 steps each
    python bench/state_attack.py --out runs/state-attack --cases pair --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from hivemind.p2p import PeerID

from diloco_core import FP32, MEAN, Codec, Merge, ReduceHandle, Transport
from diloco_train.launch import train
from diloco_train.report.plot import read_metrics
from diloco_train.run_config import build_config
from transports import ForwardingTransport

FORGED = [10**6, b"f" * 16]
HIVEMIND = [
    "transport.kind=hivemind",
    'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "transport.matchmaking_time=15.0",
    "transport.averaging_timeout=60.0",
    'transport.secret="state-attack-bench-secret-0123456789"',
    "train.ddp_warm_start=0",
    "train.checkpoint_every=0",
]


class StateForger(ForwardingTransport):
    """From its ``at``-th round on, before each round: noise in its global params (the tensors it
    broadcast), served under a fake tag (round 10^6)."""

    def __init__(self, inner: Transport, at: int) -> None:
        super().__init__(inner)
        self.at, self.rounds, self.params = at, 0, []

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        self.inner.broadcast(tensors, src=src, timeout=timeout)
        self.params += list(tensors)

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        codec: Codec = FP32,
        key: str = "default",
        merge: Merge = MEAN,
    ) -> ReduceHandle:
        if merge.judged is not None:  # a round's contribution
            self.rounds += 1
            if self.rounds >= self.at:
                with torch.no_grad():
                    for p in self.params:
                        if p.is_floating_point():
                            p.copy_(torch.randn_like(p) * 3.0)
                self.inner.load_state_dict({"tag": FORGED, "prev_tag": None})
                print(f"state-attack: forged round {self.rounds}", file=sys.stderr, flush=True)
        return self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge)


def _peer_id(err: Path) -> str:
    """The end of a peer's id as logs name it (the hex of its bytes), from its join line."""
    found = re.search(r"/p2p/(\w+)", err.read_text())
    assert found, err
    return PeerID.from_base58(found.group(1)).to_bytes().hex()[-8:]


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        found = re.search(pattern, text)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{path} ended ({proc.returncode}) before {pattern!r}")
        time.sleep(0.5)
    raise RuntimeError(f"no {pattern!r} in {path} within {timeout} s")


def _rounds(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"type": "round"' in line)


def _spawn(args: argparse.Namespace, out: Path, name: str, sets: list[str], forge: bool):
    cmd = [sys.executable, __file__, "--worker", name, "--out", str(out), "--at", str(args.at)]
    cmd += ["--forge"] if forge else []
    cmd += [a for o in sets for a in ("--set", o)]
    err = open(out / f"{name.replace('/', '-')}.err", "w")  # noqa: SIM115 - the child writes it
    return subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL, start_new_session=True)


def case(args: argparse.Namespace, name: str, *, attack: bool) -> dict:
    """One run of a case: its peers' exit codes, evals and the lines that name the insider."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pair = name.startswith("pair")
    workers = 2 if pair else 4
    roles = ["honest", "insider"] if pair else ["honest", "honest", "insider", "joiner"]
    base = [*HIVEMIND, f"train.workers={workers}", f"train.steps={args.steps}"]
    base += [f"train.num_shards={workers}", f"train.runs_dir={json.dumps(str(out))}"]
    procs: dict[int, subprocess.Popen] = {}
    joined: list[str] = []
    started: dict[int, float] = {}
    try:
        for i, role in enumerate(roles):
            if role == "insider" and not attack:
                continue
            if role == "joiner":
                while _rounds(out / name / "p0") < args.join_after:
                    time.sleep(1.0)
            sets = [*base, f"train.shard={i}", *joined]
            procs[i] = _spawn(args, out, f"{name}/p{i}", sets, forge=role == "insider")
            started[i] = time.monotonic()
            if i == 0:
                err0 = out / f"{name}-p0.err"
                addrs = _wait_for(err0, r"transport\.initial_peers=(\[[^\]]*\])", procs[0])
                joined = [f"transport.initial_peers={addrs}"]
        honest = {i: p for i, p in procs.items() if roles[i] != "insider"}
        codes = {i: p.wait(timeout=3600) for i, p in honest.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(30)
    rows = {}
    insider = _peer_id(out / f"{name}-p{roles.index('insider')}.err") if attack else None
    for i, code in codes.items():
        records = read_metrics(out / name / f"p{i}")
        summary = next((r for r in records if r["type"] == "summary"), {})
        named = None
        if insider is not None:
            lines = (out / f"{name}-p{i}.err").read_text().splitlines()
            named = next((line for line in lines if insider in line), None)
        evaluated = summary.get("eval_after")
        rows[i] = {"role": roles[i], "exit": code, "eval": evaluated, "named": named}
    return {"insider": insider, "peers": rows}


def _worker(args: argparse.Namespace) -> None:
    config = build_config(overrides=args.set)
    wrap = (lambda t: StateForger(t, args.at)) if args.forge else None
    train(config, Path(args.out) / args.worker, show_progress=False, wrap=wrap)


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    p.add_argument("--out", default="runs/state-attack")
    p.add_argument("--steps", type=int, default=200, help="inner steps per peer (train.steps)")
    p.add_argument("--at", type=int, default=3, help="the insider's first forged round")
    p.add_argument("--join-after", type=int, default=6, help="rounds of peer 0 before the joiner")
    p.add_argument("--cases", default="pair,joiner")
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--forge", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    print("| case | peer | exit | eval (attack) | eval (baseline) | vs baseline | names it |")
    print("|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        baseline = case(args, f"{name}-baseline", attack=False)
        attacked = case(args, f"{name}-attack", attack=True)
        for i, row in attacked["peers"].items():
            ref = baseline["peers"][i]["eval"]
            delta = f"{row['eval'] / ref - 1:+.2%}" if row["eval"] and ref else "-"
            said = "no" if row["named"] is None else row["named"].strip()[:90]
            cells = [name, f"p{i} ({row['role']})", row["exit"], row["eval"], ref, delta, said]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

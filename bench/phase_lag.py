"""A founder ahead in its learning-rate schedule, then two joiners (issue 43): does the robust merge leave the
honest founder out, and do the strikes bench it?

Not part of the test run. Three hivemind peers of the trainer's default model, each a process on 127.0.0.1 (its
own shard): the founder starts alone and runs ``--lone-rounds`` rounds by itself; then two joiners start from
its state. Before issue 45 (item 7) each joiner counted steps from its own 0, so its warm-up
(``train.warmup_steps``) and schedule lagged the founder's; now it takes the run's step from that state, so
the three share one ``train.steps`` and schedule, and the bench measures the swarm without that lag.
Every peer then runs ``--rounds`` more rounds. Reported from every peer's metrics and log: rounds it committed,
each peer's left-outs (the most in any 10 rounds in a row), the bench lines of the strikes.

    python bench/phase_lag.py --out runs/phase-lag
    python bench/phase_lag.py --out runs/phase-lag-mean --set diloco.merge=mean
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from insider import first_addresses  # bench/ is the script's folder: on sys.path

ROOT = Path(__file__).resolve().parents[1]
BENCH_LINE = re.compile(r"benched|left out of matchmaking", re.IGNORECASE)


def _peer(out: Path, name: str, *, steps: int, sets: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diloco_train.cli", "train", "-q", "--name", name]
    cmd += [a for s in [f"train.runs_dir={json.dumps(str(out))}", f"train.steps={steps}", *sets] for a in ("--set", s)]
    err = open(out / f"{name}.err", "w")  # noqa: SIM115 - the child writes it until it exits
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL, env=env, start_new_session=True)


def _rounds(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in (json.loads(x) for x in lines if x.strip().endswith("}")) if r["type"] == "round"]


def _most_in_ten(rounds: list[dict], who: str) -> int:
    outs = [any(o["who"] == who for o in r["left_out"]) for r in rounds]
    return max((sum(outs[i : i + 10]) for i in range(max(1, len(outs) - 9))), default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/phase-lag")
    p.add_argument("--inner-steps", type=int, default=20, help="with the default 50 warm-up steps: the founder's")
    # 3 lone rounds (60 steps) end past its warm-up, while each joiner's first rounds are inside its own
    p.add_argument("--lone-rounds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=30, help="rounds every peer runs after the joiners start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="a further trainer override, key=value")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h = args.inner_steps
    sets = [
        "transport.kind=hivemind",
        'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        'transport.secret="phase-lag-bench-secret-0123456789"',
        "transport.matchmaking_time=5.0",
        "transport.target_group_size=3",  # as docs/wan.md starts a swarm of known size: a group waits for all
        "transport.averaging_timeout=60.0",
        "train.ddp_warm_start=0",
        "train.checkpoint_every=0",
        "train.num_shards=3",
        f"train.seed={args.seed}",
        f"diloco.inner_steps={h}",
        *args.set,
    ]
    procs: list[subprocess.Popen] = []
    names = ["founder", "joiner1", "joiner2"]
    try:
        founder_steps = (args.lone_rounds + args.rounds) * h
        procs.append(_peer(out, "founder", steps=founder_steps, sets=[*sets, "train.shard=0"]))
        joined = f"transport.initial_peers={first_addresses(out / 'founder.err', procs[0])}"
        while len(_rounds(out / "founder")) < args.lone_rounds:
            if procs[0].poll() is not None:
                raise RuntimeError(f"the founder exited ({procs[0].returncode}) in its lone rounds")
            time.sleep(0.2)
        for i in (1, 2):
            # train.steps is the run's length: a joiner starts at the founder's step and ends with it
            procs.append(_peer(out, names[i], steps=founder_steps, sets=[*sets, f"train.shard={i}", joined]))
        codes = [proc.wait(timeout=3600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    runs = {n: _rounds(out / n) for n in names}
    everyone = sorted({o["who"] for rs in runs.values() for r in rs for o in r["left_out"]})
    print(f"exit codes: {dict(zip(names, codes))}")
    print("| peer | rounds | rounds with a left-out | most left-outs of one peer in 10 rounds | bench lines |")
    print("|---|---|---|---|---|")
    for n in names:
        rs = runs[n]
        worst = max((_most_in_ten(rs, w) for w in everyone), default=0)
        benches = [line for line in (out / f"{n}.err").read_text().splitlines() if BENCH_LINE.search(line)]
        print(f"| {n} | {len(rs)} | {sum(1 for r in rs if r['left_out'])} | {worst} | {len(benches)} |")
        for line in benches:
            print(f"    {n}: {line.strip()[:160]}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The trainer at a real model size (issue 47): the ``150m`` preset (151.8M parameters with the byte
tokenizer and ``model.vocab_size = 32000``) trained by ``diloco train`` on 2 gloo processes (under
torchrun) or 2 hivemind peers (processes), int4 rounds, short sequences and a small batch so that a
CPU step takes seconds. Run it on a shaped link (``bench/shaped_link.sh``: loopback at the given
rate):

    bench/shaped_link.sh 1gbit python bench/preset_run.py --transport torch --out runs/p150-torch
    bench/shaped_link.sh 1gbit python bench/preset_run.py --transport hivemind --out runs/p150-hm

Per worker it prints every round (contributors, bytes sent and received, the round's seconds, the
mean pseudo-gradient's norm: equal on every worker where their results are the same bits), the eval
losses, the final eval, the peak PSS of the worker's process tree (sampled each ``SAMPLE_SECONDS``:
its DHT, averagers and p2pd counted, shared memory once), any error line in its log and any warning
line (but the one about a secret on the command line, which this bench passes), and its start: the
state it took (a joiner's download), the seconds from its launch to its first step and its peak PSS
before and after that step. Not part of
the test run. Every child is stopped whatever happens; every wait is bounded (``TIMEOUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from insider import first_addresses
from scale import descendants, rollup

TIMEOUT = 3000.0
SAMPLE_SECONDS = 0.5
ERRORS = ("Traceback", "ERROR", "Error:", "timed out", "TimeoutError")
SETTINGS = [
    'model.preset="150m"',
    "model.vocab_size=32000",
    "train.workers=2",
    "train.num_shards=2",
    "train.batch_size=2",
    "data.seq_len=64",
    "train.warmup_steps=2",
    "train.ddp_warm_start=0",
    "train.eval_every=5",
    "train.eval_batches=2",
    "train.checkpoint_every=0",
    'diloco.codec="int4"',
    "diloco.inner_steps=5",
]
HIVEMIND = [
    'transport.kind="hivemind"',
    'transport.run_id="preset-run"',
    'transport.secret="preset-run-secret-0123456789abcdef"',
    'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "transport.target_group_size=2",
]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _watch(procs: list[subprocess.Popen], samples: dict[int, list[tuple[float, int]]]) -> None:
    """Wait for every process (at most ``TIMEOUT``), sampling each tree's PSS: (wall clock,
    bytes)."""
    deadline = time.monotonic() + TIMEOUT
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run did not end within {TIMEOUT:g} s")
        for i, p in enumerate(procs):
            if p.poll() is None:
                pss = sum(rollup(pid).get("Pss", 0) for pid in [p.pid, *descendants(p.pid)])
                samples.setdefault(i, []).append((time.time(), pss))
        time.sleep(SAMPLE_SECONDS)


def _logged_at(line: str) -> float:
    """The wall clock of a log line (its leading ``YYYY-mm-dd HH:MM:SS,mmm``, local time)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def timeline(err: Path, launched: float, samples: list[tuple[float, int]]) -> str:
    """A peer's start from its log (``-v``): the state it took (bytes, seconds), the seconds from
    its launch to its first step, and its peak PSS before and from then on."""
    lines = err.read_text().splitlines()
    pattern = re.compile(r"took ([\d.]+) GB of state .* in ([\d.]+) s")
    took = [m for line in lines if (m := pattern.search(line))]
    starts = [_logged_at(line) for line in lines if "training starts at step" in line]
    if not starts:
        return "no first step logged"
    first = starts[0]
    before = max((b for t, b in samples if t <= first), default=0) / 2**30
    after = max((b for t, b in samples if t > first), default=0) / 2**30
    state = "".join(f"took {m[1]} GB of state in {m[2]} s; " for m in took[:1])
    return (
        f"{state}first step {first - launched:.1f} s after launch; peak PSS before it "
        f"{before:.2f} GiB, from then on {after:.2f} GiB"
    )


def launch(args: argparse.Namespace) -> list[Path]:
    """Start the workers, wait for them; their run folders."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = [*SETTINGS, f"train.steps={args.steps}", f'train.runs_dir="{out}"', *args.set]
    procs: list[subprocess.Popen] = []
    launched: list[float] = []
    samples: dict[int, list[tuple[float, int]]] = {}
    try:
        if args.transport == "torch":
            torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            cmd = [sys.executable, *torchrun]
            cmd += ["-m", "diloco_train.cli", "train", "-q", "-v", "--name", "w"]
            cmd += _sets([*settings, 'transport.kind="torch"'])
            err = open(out / "w.err", "w")  # noqa: SIM115 - the child writes it until it exits
            launched.append(time.time())
            procs.append(subprocess.Popen(cmd, stderr=err, stdout=err, start_new_session=True))
            folders = [out / "w"]
        else:
            joined: list[str] = []
            for i in range(2):
                cmd = [sys.executable, "-m", "diloco_train.cli", "train", "-q", "-v"]
                cmd += ["--name", f"p{i}"]
                cmd += _sets([*settings, *HIVEMIND, f"train.shard={i}", *joined])
                err = open(out / f"p{i}.err", "w")  # noqa: SIM115 - as above
                launched.append(time.time())
                procs.append(subprocess.Popen(cmd, stderr=err, stdout=err, start_new_session=True))
                if i == 0:
                    addresses = first_addresses(out / "p0.err", procs[0])
                    joined = [f"transport.initial_peers={addresses}"]
            folders = [out / "p0", out / "p1"]
        _watch(procs, samples)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    errs = [out / f"{folder.name}.err" for folder in folders]  # each process's log
    for i, p in enumerate(procs):
        peak = max((b for _, b in samples.get(i, [])), default=0) / 2**30
        print(f"process {i}: exit {p.returncode}, peak PSS of its tree {peak:.2f} GiB")
        print(f"process {i}: {timeline(errs[i], launched[i], samples.get(i, []))}")
    return folders


def report(out: Path, folders: list[Path]) -> None:
    for err in sorted(out.glob("*.err")):
        lines = err.read_text().splitlines()
        bad = [line for line in lines if any(e in line for e in ERRORS)]
        print(f"{err.name}: {len(bad)} error line(s)" + "".join(f"\n  {b}" for b in bad[:5]))
        # a warning is not an error, but an honest run has none from its rounds (a peer named, a
        # retry)
        warned = [line for line in lines if " WARN " in line and "transport.secret" not in line]
        shown = "".join(f"\n  {w}" for w in warned[:5])
        print(f"{err.name}: {len(warned)} warning line(s)" + shown)
    for folder in folders:
        for metrics in sorted(folder.glob("**/metrics.jsonl")):
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
            print(f"== {metrics}")
            for r in records:
                if r["type"] == "round":
                    sent, received = r["bytes_sent"] / 1e6, r["bytes_received"] / 1e6
                    print(
                        f"round {r['round']}: {r['num_contributors']} contributors, sent "
                        f"{sent:.1f} MB, received {received:.1f} MB, "
                        f"comm {r['comm_s']:.2f} s, round {r['round_s']:.2f} s, "
                        f"mean pseudo-gradient norm {r['mean_pseudo_grad_norm']!r}"
                    )
                elif r["type"] == "eval":
                    print(f"eval at step {r['step']}: {r['loss']!r}")
                elif r["type"] == "summary":
                    print(f"summary: wall {r['wall_s']:.0f} s, eval {r['eval_after']!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=("torch", "hivemind"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20, help="steps per worker (5 a round)")
    parser.add_argument("--set", action="append", default=[], help="more trainer settings")
    args = parser.parse_args()
    folders = launch(args)
    report(args.out, folders)
    return 0


if __name__ == "__main__":
    sys.exit(main())

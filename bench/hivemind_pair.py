"""Two hivemind peers of one run on this machine, for bench/utilization.py: a first peer starts the swarm,
a second one joins it with the join command the first prints, each ``diloco train`` with its own data shard.

    python bench/hivemind_pair.py --runs-dir DIR --name NAME -- --set model.num_layers=6 ...

The joiner is run NAME (the one to measure: it trains from its first step with the first peer, which
waits for it in its first round) and the first peer NAME-first; their stderr goes to DIR/NAME*.err. Exits
non-zero if either peer fails, after stopping the other.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "diloco_train.cli", "train", "-q"]
COMMON = [
    "transport.kind=hivemind",
    'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    'transport.secret="bench"',
    "transport.target_group_size=2",
    "transport.matchmaking_time=15.0",  # the first peer's first round waits for the joiner's
    "transport.averaging_timeout=120.0",
    "train.num_shards=2",
    "train.threads=1",  # one torch thread per peer, as the trainer gives each of two torchrun workers
]


def join_addresses(err: Path) -> list[str] | None:
    """The ``transport.initial_peers`` of the join command a first peer prints on stderr, once it has."""
    for line in err.read_text().splitlines() if err.is_file() else []:
        for arg in shlex.split(line) if "transport.initial_peers=" in line else []:
            if arg.startswith("transport.initial_peers="):
                return json.loads(arg.split("=", 1)[1])
    return None


def peer(name: str, sets: list[str], runs_dir: Path, *, verbose: bool = False) -> tuple[subprocess.Popen, Path]:
    """A ``diloco train`` peer process writing its stderr to ``runs_dir/name.err`` (``verbose``: INFO lines too)."""
    err = runs_dir / f"{name}.err"
    argv = [*CLI, *(["-v"] if verbose else []), "--name", name, *[a for s in [*COMMON, *sets] for a in ("--set", s)]]
    with open(err, "w") as f:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=f), err


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs-dir", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--join-timeout", type=float, default=120.0)
    p.add_argument("sets", nargs=argparse.REMAINDER, help="-- then the trainer's --set arguments")
    args = p.parse_args(argv)
    sets = [s for s in args.sets if s not in ("--", "--set")]
    runs_dir = args.runs_dir
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs_dir_set = [f"train.runs_dir={json.dumps(str(runs_dir))}"]
    first, first_err = peer(f"{args.name}-first", [*sets, *runs_dir_set, "train.shard=0"], runs_dir)
    procs = [first]
    try:
        deadline = time.monotonic() + args.join_timeout
        while (addresses := join_addresses(first_err)) is None:
            if first.poll() is not None or time.monotonic() > deadline:
                print(f"the first peer printed no join command: {first_err}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        joined = [*sets, *runs_dir_set, "train.shard=1", f"transport.initial_peers={json.dumps(addresses)}"]
        procs.append(peer(args.name, joined, runs_dir)[0])
        codes = [proc.wait() for proc in reversed(procs)]
        if any(codes):
            print(f"peer exit codes {codes[::-1]} (first, joiner): see {runs_dir}/{args.name}*.err", file=sys.stderr)
        return max(codes)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())

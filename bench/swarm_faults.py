"""The swarm-faults benchmark: hivemind peers (``diloco train`` processes on 127.0.0.1) under a kill, or under a
seeded schedule of interruptions, and what the survivors' rounds cost.

Not part of the test run. Two scenarios:

- ``kill``: 3 peers with ``transport.target_group_size=3`` (docs/wan.md's advice); peer 2 is SIGKILLed once the
  swarm has committed ``--kill-round`` rounds and is not restarted. Reported: the survivors' round times (rank
  0's ``round_s`` plus the inner steps' wall between rounds: the time from one round's end to the next's) before
  the kill and in each round after it, and whether the survivors' log names the peer that left.
- ``schedule``: 4 peers (``transport.target_group_size=4``), elastic rounds (``diloco.round_seconds``), a
  fault-free run and a run under a seeded
  schedule: every peer but the first (the swarm's bootstrap address) is interrupted at times drawn from an
  exponential distribution of mean ``--mtbi-rounds`` rounds, each time either killed and restarted
  ``--restart-delay`` seconds later (a new process, a joiner of the run), or stalled (SIGSTOP) for
  ``--stall`` seconds. Goodput = the busy seconds of every peer process's steps up to its last committed round
  (work after it is lost) over 4 x the swarm's wall time, from when every peer has begun training until the
  first peer ends (evaluations only at the end: each peer evaluates, and the time would count as idle); also
  over the peer-seconds less the schedule's restart delays (the machines it switched off), and less those and
  the seconds it held processes stopped (what the swarm had to work with); the final eval loss
  of the first peer against the fault-free run's. ``--quorum`` (default 2; 0: the lock-step wait) is the
  peers' ``transport.quorum``.

    PYTHONPATH=src python bench/swarm_faults.py kill --out runs/faults-kill          # about 3 minutes
    PYTHONPATH=src python bench/swarm_faults.py schedule --out runs/faults --seed 0  # about 10 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hivemind_pair import join_addresses, peer

__all__ = ["goodput_of", "main", "round_times"]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def round_times(records: list[dict]) -> list[tuple[int, float]]:
    """(round, seconds from the previous round's end to this one's end) from a peer's metrics (step records'
    ``time_s``: the step that ended a round is the one after the round record)."""
    out, last, pending = [], None, None
    for r in records:
        if r.get("type") == "round":
            pending = r["round"]
        elif r.get("type") == "step" and pending is not None:
            if last is not None:
                out.append((pending, r["time_s"] - last))
            last, pending = r["time_s"], None
    return out


def goodput_of(runs: list[list[dict]], *, workers: int, wall: float) -> float:
    """The busy seconds of every process's steps up to its last committed round, over ``workers`` x ``wall``."""
    useful = 0.0
    for records in runs:
        last_round_step = max((i for i, r in enumerate(records) if r.get("type") == "round"), default=-1)
        useful += sum(r["compute_s"] for r in records[: last_round_step + 2] if r.get("type") == "step")
    return useful / (workers * wall)


class Swarm:
    """Peer processes of one run, started with the first one's join addresses."""

    def __init__(self, out: Path, sets: list[str], *, verbose: bool = False) -> None:
        self.out, self.sets, self.verbose = out, sets, verbose
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: list[str] | None = None
        self.started: dict[str, float] = {}  # monotonic time each process was started
        self.first_step: dict[str, float] = {}  # seconds from its start to its first step's record (polled)

    def start(self, name: str, shard: int) -> None:
        sets = [*self.sets, f"train.runs_dir={json.dumps(str(self.out))}", f"train.shard={shard}"]
        if self.addresses is not None:
            sets.append(f"transport.initial_peers={json.dumps(self.addresses)}")
        self.procs[name], err = peer(name, sets, self.out, verbose=self.verbose)
        self.started[name] = time.monotonic()
        if self.addresses is None:
            deadline = time.monotonic() + 120
            while (found := join_addresses(err)) is None:
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the first peer printed no join command: {err}")
                time.sleep(0.2)
            self.addresses = found

    def poll_first_steps(self) -> None:
        """Note, for each process that has not trained yet, whether its first step is on record now."""
        for name in self.procs.keys() - self.first_step.keys():
            if any(r.get("type") == "step" for r in _metrics(self.out / name)):
                self.first_step[name] = time.monotonic() - self.started[name]

    def rounds(self, name: str) -> int:
        return max((r["round"] for r in _metrics(self.out / name) if r.get("type") == "round"), default=0)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


HIVEMIND = ["transport.kind=hivemind", 'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', 'transport.secret="bench"']


def kill(args: argparse.Namespace) -> str:
    sets = [*HIVEMIND, "transport.target_group_size=3", "train.num_shards=3", "train.threads=1",
            f"train.steps={args.steps}", "train.checkpoint_every=0"]  # fmt: skip
    swarm = Swarm(args.out, sets)
    try:
        for i in range(3):
            swarm.start(f"peer{i}", i)
        while swarm.rounds("peer0") < args.kill_round:
            if swarm.procs["peer0"].poll() is not None:
                raise RuntimeError("peer0 ended before the kill")
            time.sleep(0.2)
        os.kill(swarm.procs["peer2"].pid, signal.SIGKILL)
        killed_at = swarm.rounds("peer0")
        for name in ("peer0", "peer1"):
            swarm.procs[name].wait(args.timeout)
    finally:
        swarm.close()
    times = round_times(_metrics(args.out / "peer0"))
    before = [t for r, t in times if 2 <= r <= killed_at]
    after = [(r, t) for r, t in times if r > killed_at]
    said = [line for line in (args.out / "peer0.err").read_text().splitlines() if "left the swarm's rounds" in line]
    lines = [
        f"killed peer2 after round {killed_at}; peer0's median round time (s) before it: "
        + f"{statistics.median(before):.2f} (rounds 2..{killed_at})",
        "after it: " + ", ".join(f"round {r}: {t:.2f}" for r, t in after[:6]),
        f"peer0's log: {said[0] if said else 'NO LINE about the peer that left'}",
    ]
    return "\n".join(lines)


def _schedule(seed: int, *, peers: int, mean: float, horizon: float) -> list[tuple[float, int, str]]:
    """(seconds after the start, peer, "kill" or "stall"), peer 0 never (it holds the swarm's address)."""
    rng, events = random.Random(seed), []
    for p in range(1, peers):
        t = rng.expovariate(1 / mean)
        while t < horizon:
            events.append((t, p, rng.choice(("kill", "stall"))))
            t += rng.expovariate(1 / mean)
    return sorted(events)


def schedule(args: argparse.Namespace) -> str:
    sets = [*HIVEMIND, "transport.target_group_size=4", "train.num_shards=4", "train.threads=1", f"train.steps={args.steps}",
            "train.checkpoint_every=0", f"train.eval_every={args.steps}", f"diloco.round_seconds={args.round_seconds}",
            f"transport.quorum={args.quorum}"]  # fmt: skip
    results, restarted = [], []
    for faulty in (False, True):
        out = args.out / ("faults" if faulty else "fault-free")
        out.mkdir(parents=True, exist_ok=True)
        swarm, start = Swarm(out, sets, verbose=args.verbose), time.monotonic()
        names = {p: f"peer{p}" for p in range(4)}
        events = _schedule(args.seed, peers=4, mean=args.mtbi_rounds * args.round_seconds, horizon=10**9)
        restarts: list[tuple[float, int]] = []
        kills: list[float] = []
        stalls: list[float] = []
        done = 0
        try:
            for p in range(4):
                swarm.start(names[p], p)
            while not all(_metrics(out / f"peer{p}") for p in range(4)):  # every peer up and training
                if time.monotonic() - start > args.timeout:
                    raise RuntimeError("the peers did not all start training")
                time.sleep(0.2)
            start = time.monotonic()  # the schedule and the wall count from here (start-up is no training)
            while swarm.procs["peer0"].poll() is None and time.monotonic() - start < args.timeout:
                now = time.monotonic() - start
                while faulty and events and events[0][0] <= now:
                    _, p, kind = events.pop(0)
                    proc = swarm.procs[names[p]]
                    if proc.poll() is not None:
                        continue
                    if kind == "kill":
                        proc.kill()
                        restarts.append((now + args.restart_delay, p))
                        kills.append(now)
                        print(f"{now:.0f}s: killed {names[p]}", file=sys.stderr)
                    else:
                        os.kill(proc.pid, signal.SIGSTOP)
                        stalls.append(now)
                        time.sleep(args.stall)
                        os.kill(proc.pid, signal.SIGCONT)
                        print(f"{now:.0f}s: stalled {names[p]} for {args.stall:g}s", file=sys.stderr)
                    done += 1
                for when, p in [r for r in restarts if r[0] <= now]:
                    restarts.remove((when, p))
                    names[p] = f"peer{p}-r{sum(n.startswith(f'peer{p}') for n in swarm.procs)}"
                    swarm.start(names[p], p)
                    print(f"{now:.0f}s: restarted as {names[p]}", file=sys.stderr)
                swarm.poll_first_steps()
                time.sleep(0.2)
            wall = time.monotonic() - start
        finally:
            swarm.close()
        runs = [_metrics(out / name) for name in swarm.procs]
        summary = next((r for r in _metrics(out / "peer0") if r.get("type") == "summary"), {})
        off = sum(min(args.restart_delay, wall - t) for t in kills)  # the schedule's own downtime (machines off)
        stopped = sum(min(args.stall, wall - t) for t in stalls)  # and the time it held processes stopped
        good = goodput_of(runs, workers=4, wall=wall)
        useful = good * 4 * wall
        shares = (good, useful / (4 * wall - off), useful / (4 * wall - off - stopped))
        results.append((faulty, shares, summary.get("eval_after"), done, wall))
        joins = [
            f"{n} {swarm.first_step[n]:.1f}s" if n in swarm.first_step else f"{n} never"
            for n in swarm.procs
            if "-r" in n
        ]
        restarted.append(", ".join(joins) or "none")
    lines = [
        f"quorum {args.quorum}, round_seconds {args.round_seconds:g}, seed {args.seed}",
        "",
        (
            "| run | goodput | of the peers not switched off | of the peers neither off nor stopped "
            "| final eval loss (peer0) | interruptions | wall s |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for faulty, (good, on, running), loss, done, wall in results:
        name = "faults" if faulty else "fault-free"
        lines.append(f"| {name} | {good:.3f} | {on:.3f} | {running:.3f} | {loss} | {done} | {wall:.0f} |")
    lines += ["", f"restarted peers, from their start to their first step: {restarted[-1]}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=("kill", "schedule"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200, help="nominal steps (rounds x inner_steps)")
    p.add_argument("--kill-round", type=int, default=6)
    p.add_argument("--round-seconds", type=float, default=5.0)
    p.add_argument("--mtbi-rounds", type=float, default=10.0, help="mean rounds between a peer's interruptions")
    p.add_argument("--restart-delay", type=float, default=10.0)
    p.add_argument("--stall", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quorum", type=int, default=2, help="transport.quorum (0: every round waits for every peer)")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--verbose", action="store_true", help="the peers log INFO lines too (timestamped, in PEER.err)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    text = kill(args) if args.scenario == "kill" else schedule(args)
    (args.out / f"{args.scenario}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

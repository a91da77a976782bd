"""Peers that cannot accept connections, over links with latency: the trainer on hivemind in network namespaces.

Not part of the test run; root only. ``--peers`` peers (default 4; ``diloco train``, hivemind, one process
each, 1 torch thread), each in a network namespace of its own behind its own ``tc tbf`` link (``--rate``, both
directions) with ``--delay`` seconds of one-way delay (``tests/netns.py``; netem is absent here). Two
swarms on the same links, same seeds:

- ``public``: every peer accepts connections;
- ``nat``: only the first ``--public`` peers do (default 1); the others have private addresses and listen on
  their own loopback only (nobody can connect to them, nor they to each other). ``transport.reachability`` is left at ``auto``: they find
  they are behind NAT and reach the others through the public peers' relays.

Delay: every connection is accepted by a public peer, which listens on its loopback behind a delaying relay
(``tests/delay_proxy.py``) holding each byte 2 x ``--delay`` in each direction: one direction of a
connection crosses two links (the dialer's and the acceptor's), each with ``--delay``; a relayed connection
between two private peers crosses the relay twice (4 x ``--delay``), as it crosses four links.

Per swarm: each peer's share of rounds it contributed to (``num_contributors`` = 4 on its records), its
goodput (the trainer's summary: busy seconds over the loop's wall), its final eval loss (the peers'
replicas are the same where these are bit-identical), the mean round time; per swarm, the rounds whose
mean pseudo-gradient norm is bit-identical on every peer (the same mean everywhere, round by round),
and a round's time (H steps' compute and the sync, medians over every peer's rounds from the third
on with every peer in) against ``diloco plan``'s prediction for the same link and the measured step
time: a peer to peer one-way latency of 2 x ``--delay`` (``diloco_train.plan``, ``routes``).

    PYTHONPATH=src python bench/reachability.py --out runs/reach         # 2 swarms x 300 steps
    PYTHONPATH=src python bench/reachability.py --out runs/reach --quick # 60 steps
    PYTHONPATH=src python bench/reachability.py --out runs/reach8 --peers 8 --public 2 --swarms nat
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import netns
from insider import first_addresses  # bench/, this script's folder

from diloco_train.model import ModelConfig, count_parameters
from diloco_train.plan import Link, Method, seconds_per_round
from diloco_train.routes import route

PORT, PROXY_PORT = 4000, 4001
H = 10  # the trainer's inner steps (its default)
SECRET = "reachability-bench-secret-0123456789"


def _peer_cmd(*, out: Path, k: int, workers: int, args: argparse.Namespace, sets: list[str]) -> list[str]:
    base = [
        "train.mode=diloco",
        f"diloco.inner_steps={H}",
        f"train.steps={args.steps}",
        f"train.num_shards={workers}",
        f"train.shard={k}",
        "train.checkpoint_every=0",
        "train.ddp_warm_start=0",
        "train.threads=1",
        f"train.runs_dir={json.dumps(str(out))}",
        "transport.kind=hivemind",
        f"transport.secret={json.dumps(SECRET)}",
        f"transport.target_group_size={workers}",
        "transport.matchmaking_time=15.0",
        *sets,
    ]
    return [
        sys.executable,
        "-m",
        "diloco_train.cli",
        "train",
        "--name",
        f"p{k}",
        *[a for s in base for a in ("--set", s)],
    ]


def swarm(name: str, *, private: set[int], args: argparse.Namespace) -> None:
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    workers = args.peers
    with netns.Network(peers=workers, rate=args.rate, private=private) as net:
        procs = []
        public: list[str] = []  # the public peers' addresses so far: a client's relays
        for k in range(workers):
            if k in private:
                sets = ['transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]']
            else:
                proxy = [sys.executable, str(HERE.parent / "tests" / "delay_proxy.py")]
                proxy += ["--listen", f"{net.address(k)}:{PROXY_PORT}", "--to", f"127.0.0.1:{PORT}"]
                proxy += ["--delay", str(2 * args.delay)]
                net.popen(k, proxy, stdout=subprocess.DEVNULL)
                sets = [f'transport.host_maddrs=["/ip4/127.0.0.1/tcp/{PORT}"]']
                sets.append(f'transport.announce_maddrs=["/ip4/{net.address(k)}/tcp/{PROXY_PORT}"]')
            if public:
                sets.append(f"transport.initial_peers={json.dumps(public)}")
            err = out / f"p{k}.err"
            cmd = _peer_cmd(out=out, k=k, workers=workers, args=args, sets=sets)
            with open(err, "w") as f:
                procs.append(net.popen(k, cmd, stderr=f, stdout=subprocess.DEVNULL))
            if k not in private:
                public += json.loads(first_addresses(err, procs[k]))
        for k, p in enumerate(procs):
            if p.wait(timeout=3600) != 0:
                raise RuntimeError(f"{name}: peer {k} exited with {p.returncode} (see {out}/p{k}.err)")


def summarize(name: str, args: argparse.Namespace) -> dict:
    rows = []
    # per round: its mean pseudo-gradient norms, and the peers that recorded it
    norms: dict[int, tuple[set[float], set[int]]] = {}
    for k in range(args.peers):
        lines = (Path(args.out) / name / f"p{k}" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        rounds = [r for r in records if r["type"] == "round"]
        for r in rounds:
            seen = norms.setdefault(r["round"], (set(), set()))
            seen[0].add(r["mean_pseudo_grad_norm"])
            seen[1].add(k)
        summary = next(r for r in records if r["type"] == "summary")
        full = sum(r["num_contributors"] == args.peers for r in rounds)
        rows.append({"peer": k, "rounds": len(rounds), "with_all": full, "goodput": summary["goodput"],
                     "eval_after": summary["eval_after"], "wall_s": summary["wall_s"],
                     "round_s": statistics.mean(r["round_s"] for r in rounds)})  # fmt: skip
    # the rounds every peer recorded (a round one peer averaged alone proves nothing)
    everyone = [v for v in norms.values() if len(v[1]) == args.peers]
    same = sum(len(v[0]) == 1 for v in everyone)
    return {"name": name, "peers": rows, "rounds_with_one_mean": same, "rounds_seen": len(everyone),
            "plan": against_plan(name, args)}  # fmt: skip


def against_plan(name: str, args: argparse.Namespace) -> dict:
    """A round's measured time (H steps and the sync) and ``diloco plan``'s for the same link."""
    steps, syncs = [], []
    for k in range(args.peers):
        lines = (Path(args.out) / name / f"p{k}" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        steps += [r["compute_s"] for r in records if r["type"] == "step" and r["step"] > 2 * H]
        syncs += [r["comm_s"] for r in records if r["type"] == "round" and r["round"] >= 3
                  and r["num_contributors"] == args.peers]  # fmt: skip
    if not syncs:  # no round from the third on had every peer
        return {"rounds": 0}
    step_s = statistics.median(steps)
    clients = args.peers - args.public if name == "nat" else 0
    params = count_parameters(ModelConfig())
    sync = route(params, "int4", transport="hivemind", workers=args.peers, clients=clients)
    link = Link(mbit=float(args.rate.removesuffix("mbit")), latency_ms=2e3 * args.delay)
    planned = seconds_per_round(
        step_s=step_s,
        round_bytes=sync.bytes_out,
        link=link,
        workers=args.peers,
        method=Method("blocking", H),
        latencies=sync.latencies,
    )
    sync_s = statistics.median(syncs)
    return {
        "step_s": step_s,
        "sync_s": sync_s,
        "round_s": H * step_s + sync_s,
        "planned_round_s": planned,
        "planned_sync_s": planned - H * step_s,
        "rounds": len(syncs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--delay", type=float, default=0.05, help="one-way seconds per link")
    p.add_argument("--quick", action="store_true", help="60 steps")
    p.add_argument("--swarms", default="nat,public")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--public", type=int, default=1, help="peers that accept connections (nat swarm)")
    args = p.parse_args(argv)
    if (why := netns.available()) is not None:
        p.error(why)
    if args.quick:
        args.steps = 60
    results = []
    for name in args.swarms.split(","):
        if not (Path(args.out) / name / "p0" / "metrics.jsonl").is_file():
            private = set(range(args.public, args.peers)) if name == "nat" else set()
            swarm(name, private=private, args=args)
        results.append(summarize(name, args))
    for r in results:
        for row in r["peers"]:
            print(f"{r['name']:7s} peer {row['peer']}: {row['with_all']}/{row['rounds']} rounds with all, "
                  f"goodput {row['goodput']:.3f}, eval {row['eval_after']!r}, wall {row['wall_s']:.1f} s, "
                  f"round {row['round_s']:.2f} s")  # fmt: skip
        print(f"{r['name']:7s}: the mean's norm equal on every peer in {r['rounds_with_one_mean']} of "
              f"the {r['rounds_seen']} rounds every peer recorded")  # fmt: skip
        q = r["plan"]
        if not q["rounds"]:
            print(f"{r['name']:7s}: no round from the third on had every peer: no plan check")
            continue
        off = 100 * (q["planned_round_s"] / q["round_s"] - 1)
        print(
            f"{r['name']:7s}: a round {q['round_s']:.3f} s ({H} steps of {q['step_s']:.4f} s, "
            f"sync {q['sync_s']:.3f} s; {q['rounds']} rounds), diloco plan "
            f"{q['planned_round_s']:.3f} s (sync {q['planned_sync_s']:.3f} s): {off:+.1f}%"
        )
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

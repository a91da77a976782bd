"""Issue 43's acceptance figures on hivemind peers (processes on 127.0.0.1, ``target_group_size``
set as docs/wan.md's command sets it): what a failing or departed peer costs the others' rounds.

- ``failing``: ``--peers`` peers (3 or 4); the last one's part exchange fails from round
  ``--fail-from`` on (``HivemindFaults.exchange_fails``: it sends no part, and answers every part
  with an error). Reported: each survivor's round times before the fault and in each round after it,
  and every peer's exit code.
- ``alone``: 2 peers; the second is stopped with Ctrl+C (SIGINT) once the first has committed
  ``--fail-from - 1`` rounds. Reported: the survivor's round times before and after, its exit code,
  and its line about the peer.

A round's time: from the end of one round to the end of the next (its inner steps included). Not
part of the test run.

    PYTHONPATH=src python bench/failing_peer.py failing --peers 3
    PYTHONPATH=src python bench/failing_peer.py alone
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INNER_STEPS = 50


def peer(args: dict) -> int:
    """One peer: DiLoCo rounds of a small model; one JSON line per round on stdout; exit 2 on a
    failed round."""
    import torch

    from diloco_core import DiLoCo, DiLoCoConfig, TransportError
    from transports.hivemind import HivemindConfig, HivemindFaults, HivemindTransport

    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    flag = args["flag"]
    fails = (lambda: os.path.exists(flag)) if args["faulty"] else None
    faults = HivemindFaults(exchange_fails=fails)
    cfg = HivemindConfig(
        run_id=args["run_id"],
        secret="bench-secret-of-the-failing-peer",
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=args["matchmaking_time"],
        averaging_timeout=args["averaging_timeout"],
        target_group_size=args["peers"],
        initial_peers=args["initial_peers"],
    )
    transport = HivemindTransport(cfg, faults=faults)
    try:
        print(json.dumps({"addr": transport.join_addresses}), flush=True)
        torch.manual_seed(0)
        width = 256
        layers = (torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
        model = torch.nn.Sequential(*layers)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = DiLoCoConfig(inner_steps=INNER_STEPS, reduce_timeout=transport.own_timeout)
        dl = DiLoCo(model, inner, transport, config)
        data = torch.Generator().manual_seed(args["rank"])
        last = time.monotonic()
        while dl.round < args["rounds"]:  # the swarm's rounds (a joiner starts from the swarm's)
            if args["faulty"] and dl.round + 1 >= args["fail_from"]:
                Path(flag).touch()
            for _ in range(INNER_STEPS):
                x = torch.randn(64, 256, generator=data)
                (model(x) - x.flip(1)).pow(2).mean().backward()
                report = dl.step()
                inner.zero_grad()
            now = time.monotonic()
            n = None if report is None else report.num_contributors
            line = {"round": dl.round, "seconds": now - last, "contributors": n}
            print(json.dumps(line), flush=True)
            last = now
        return 0
    except TransportError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        transport.close()


def _start(args: argparse.Namespace, rank: int, out: Path, extra: dict) -> subprocess.Popen:
    spec = {"rank": rank, "peers": args.peers, "rounds": args.rounds, "fail_from": args.fail_from}
    spec |= {"matchmaking_time": args.matchmaking_time, "averaging_timeout": args.averaging_timeout}
    spec |= extra
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.Popen(
        [sys.executable, __file__, "peer", json.dumps(spec)],
        stdout=open(out / f"peer{rank}.out", "w"),
        stderr=open(out / f"peer{rank}.err", "w"),
        env=env,
    )


def _shown(x: dict) -> str:
    return f"{x['round']}: {x['seconds']:.2f} s ({x['contributors']})"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def run(args: argparse.Namespace) -> str:
    out = Path(tempfile.mkdtemp(prefix=f"failing-{args.scenario}-"))
    common = {"run_id": f"failing-{os.getpid()}", "flag": str(out / "fail"), "initial_peers": []}
    procs = [_start(args, 0, out, common | {"faulty": False})]
    deadline = time.monotonic() + 120
    while not (addr := [x["addr"] for x in _lines(out / "peer0.out") if "addr" in x]):
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise RuntimeError((out / "peer0.err").read_text()[-2000:])
        time.sleep(0.2)
    for rank in range(1, args.peers):
        faulty = args.scenario == "failing" and rank == args.peers - 1
        procs.append(_start(args, rank, out, common | {"faulty": faulty, "initial_peers": addr[0]}))
    try:
        # alone: Ctrl+C to the second peer once the first has committed the rounds before
        if args.scenario == "alone":
            while sum("round" in x for x in _lines(out / "peer0.out")) < args.fail_from - 1:
                time.sleep(0.1)
            procs[1].send_signal(signal.SIGINT)
        codes = [p.wait(args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    stopped = args.peers - 1
    what = "fails" if args.scenario == "failing" else "stopped"
    head = f"{args.scenario}: {args.peers} peers, target_group_size {args.peers}, matchmaking_time "
    head += f"{args.matchmaking_time:g} s; peer {stopped} {what} from round {args.fail_from}; "
    head += f"exit codes {codes}"
    lines = [head + f"; logs in {out}"]
    for rank in range(stopped):
        rounds = [x for x in _lines(out / f"peer{rank}.out") if "round" in x]
        # round 2 waits for the joiners' start
        before = [x["seconds"] for x in rounds if 3 <= x["round"] < args.fail_from]
        failed = [x for x in rounds if x["round"] >= args.fail_from]
        after = ", ".join(_shown(x) for x in failed)
        base = statistics.median(before) if before else float("nan")
        # from the 2nd round after on
        later = [x["seconds"] for x in rounds if x["round"] >= args.fail_from + 2]
        ratio = statistics.median(later) / base if later and before else float("nan")
        times = ", ".join(f"{t:.2f}" for t in before)
        lines.append(f"peer {rank}: rounds before {times} s (median {base:.2f} s)")
        lines.append(f"  after (round: time (contributors)): {after}")
        lines.append(f"  median from the 2nd round after on / median before: {ratio:.2f}")
        err = (out / f"peer{rank}.err").read_text().splitlines()
        for what in ("failed its part exchange", "left the swarm's rounds"):
            said = [e for e in err if what in e]
            lines.append(f"  lines '{what}': {len(said)}{': ' + said[0][:240] if said else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "peer":
        return peer(json.loads(argv[1]))
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    p.add_argument("scenario", choices=("failing", "alone"))
    p.add_argument("--peers", type=int, default=None, help="failing: 3 or 4 (default 3); alone: 2")
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--fail-from", type=int, default=7)
    p.add_argument("--matchmaking-time", type=float, default=5.0)
    p.add_argument("--averaging-timeout", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    args.peers = 2 if args.scenario == "alone" else (args.peers or 3)
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

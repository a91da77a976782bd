"""Insiders against the merge: one worker of three attacks every round, and the run's final eval loss is compared
with the two honest workers training alone. The attacks: its pseudo-gradient scaled (x1e6, x-1e6, x-10: what the
merge judges, ``Merge.judged``), or one control value of the guard's tail forged (``work=``, ``valid=``,
``digest=``: what the merge judges per contributor, ``Merge.controls``).

Not part of the test run. Every run is the trainer's default run (``diloco train``) but for the number of
workers, ``--steps`` and ``--set`` overrides; the insider is the last worker, a ``ForwardingTransport`` that
changes what it sends. ``--merge mean`` shows what the plain mean does with the same insiders.

    python bench/insider.py --out runs/insider                      # in-process workers (threads)
    python bench/insider.py --out runs/insider --attacks work=-2.9999,valid=-2,digest=3.5   # forged control values
    python bench/insider.py --out runs/insider-gloo --transport torch   # 3 gloo processes under torchrun
    python bench/insider.py --out runs/insider-hm --transport hivemind --workers 4  # 4 hivemind peers (processes)
    python bench/insider.py --out runs/insider-hm --transport hivemind --workers 4 --attacks=x-1e6 --late 40
        # a group of two at the start: the founder and the insider, the two other honest peers 40 s later
    python bench/insider.py --out runs/insider-long --steps 330 --attacks=x-1 --set diloco.norm_clip=4  # 30 rounds
    python bench/insider.py --out runs/insider-hm --transport hivemind --workers 4 --attacks relay
        # as a part's owner, the insider relays its own payload in the others' places (int4)
    python bench/insider.py --out runs/insider-hm-fp16 --transport hivemind --workers 4 \
        --attacks reducer-100 --set 'diloco.codec="fp16"'
        # as a part's owner, it sends back -100 x what it relays (a cast wire)

On hivemind every peer is a process of its own on 127.0.0.1 (its own shard of the data, ``train.num_shards``);
the first prints its join command, the others join its addresses; the honest baseline is one peer fewer.
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

from diloco_core import FP32, MEAN, Codec, Merge, ReduceHandle, Transport
from diloco_core.rules import from_mapping
from diloco_train.report.plot import read_metrics
from diloco_train.run_config import build_config
from diloco_train.train import train
from transports import ForwardingTransport
from transports.hivemind import HivemindConfig, HivemindFaults, HivemindTransport


class Insider(ForwardingTransport):
    """One insider's attack on every round's contribution: ``x<scale>`` sends the pseudo-gradient times
    ``scale`` (a worker whose software, or owner, went wrong); ``work=<v>``, ``valid=<v>`` and ``digest=<v>``
    send that control value in the guard's tail (``Merge.controls``) instead of the honest one."""

    def __init__(self, inner: Transport, attack: str) -> None:
        super().__init__(inner)
        self.attack = attack

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], *, codec: Codec = FP32, key: str = "default", merge: Merge = MEAN
    ) -> ReduceHandle:
        flat = tensors[0].view(-1)
        if merge.judged is not None and self.attack.startswith("x"):  # [pseudo-gradient | guard tail]
            flat[: merge.judged].mul_(float(self.attack[1:]))
        elif merge.controls is not None:
            what, value = self.attack.split("=")
            at = getattr(merge.controls, f"{what}_at")
            flat[at : at + merge.controls.block] = float(value)
        return self.inner.all_reduce(tensors, codec=codec, key=key, merge=merge)


def _overrides(args: argparse.Namespace, workers: int, out: Path) -> list[str]:
    return [
        f"train.workers={workers}",
        f"train.steps={args.steps}",
        "train.checkpoint_every=0",
        f"train.runs_dir={json.dumps(str(out))}",
        f"diloco.merge={args.merge}",
        *args.set,
    ]


RELAYS = {
    "relay": lambda: HivemindFaults(relay_payloads=lambda others, own: [own] * len(others)),
    "reducer-100": lambda: HivemindFaults(reducer_sends_mean=lambda t: t * -100),
}
"""hivemind insiders as a part's owner, inside its averagers (``HivemindFaults``, which a transport
takes only as it is built: the trainer's ``create`` seam builds the insider's)."""


def _relaying(attack: str):
    """The insider's transport, built with its fault (``train``'s ``create``)."""

    def create(section, *, reduce_timeout=None):
        fields = {k: v for k, v in section.items() if k != "kind"}
        config = from_mapping(HivemindConfig, fields, "transport")
        return HivemindTransport(config, faults=RELAYS[attack]())

    return create


def _wrap(attack: str | None, insider_rank: int):
    if attack is None:
        return None
    return lambda t: Insider(t, attack) if t.rank == insider_rank else t


HIVEMIND = [
    "transport.kind=hivemind",
    'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "transport.matchmaking_time=15.0",  # the first round waits for every peer to start (a group forms once all are in)
    "transport.averaging_timeout=60.0",
    "train.ddp_warm_start=0",
]


def _hivemind(args: argparse.Namespace, *, name: str, workers: int, attack: str | None, overrides: list[str]) -> None:
    """``workers`` peers as processes; the last is the insider (if ``attack``). Their run folders: name-pN."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [*overrides, *HIVEMIND, f"train.num_shards={workers}", f"transport.target_group_size={workers}"]
    base.append('transport.secret="insider-bench-secret-0123456789"')
    procs: list[subprocess.Popen] = []
    try:
        joined: list[str] = []
        # --late: the insider starts second, the other honest peers ``late`` s after it (a pair first)
        order = [0, workers - 1, *range(1, workers - 1)] if args.late else list(range(workers))
        delayed = order[2] if args.late and workers > 2 else None  # the first of the late peers
        for i in order:
            if i == delayed:
                time.sleep(args.late)
            sets = [*base, f"train.shard={i}", *joined]
            cmd = [sys.executable, __file__, "--worker", f"{name}/p{i}", "--out", str(out)]
            cmd += ["--attack", str(attack if i == workers - 1 else None)]
            cmd += [a for o in sets for a in ("--set", o)]
            err = open(out / f"{name}-p{i}.err", "w")  # noqa: SIM115 - the child writes it until it exits
            procs.append(subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL, start_new_session=True))
            if i == 0:
                joined = [f"transport.initial_peers={first_addresses(out / f'{name}-p0.err', procs[0])}"]
        by_index = dict(zip(order, procs))
        honest = range(workers) if attack is None else range(workers - 1)
        for i in honest:
            if by_index[i].wait(timeout=3600) != 0:
                raise RuntimeError(
                    f"an honest peer of {name} exited with {by_index[i].returncode} (see {out}/{name}-p{i}.err)"
                )
        if attack is not None:  # benched, the insider averages its own updates alone: its run may end or crawl on
            insider = by_index[workers - 1]
            try:
                insider.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(insider.pid, 15)
                insider.wait(timeout=30)
            print(f"{name}: the insider's own run ended with exit code {insider.returncode} (after the honest peers)")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)


def first_addresses(err: Path, proc: subprocess.Popen) -> str:
    """The addresses the first peer printed in its join command (a JSON list)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(r"transport\.initial_peers=(\[[^\]]*\])", err.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"the first peer exited ({proc.returncode}): {err}")
        time.sleep(0.5)
    raise RuntimeError(f"the first peer printed no join command within 120 s: {err}")


def run(args: argparse.Namespace, *, name: str, workers: int, attack: str | None) -> dict:
    """One run (read back if finished): its eval loss and how many rounds left someone out."""
    out = Path(args.out)
    run_dir = out / name / "p0" if args.transport == "hivemind" else out / name
    if not (run_dir / "metrics.jsonl").is_file() or not any(r["type"] == "summary" for r in read_metrics(run_dir)):
        overrides = _overrides(args, workers, out)
        if args.transport == "torch":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers), "--master-port"]
            cmd += [str(args.port), __file__, "--worker", name, "--attack", str(attack), "--out", str(out)]
            cmd += [a for o in [*overrides, "transport.kind=torch"] for a in ("--set", o)]
            subprocess.run(cmd, check=True, timeout=3600)
        elif args.transport == "hivemind":
            _hivemind(args, name=name, workers=workers, attack=attack, overrides=overrides)
        else:
            try:
                train(build_config(overrides=overrides), run_dir, show_progress=False, wrap=_wrap(attack, workers - 1))
            except ValueError as e:  # the trainer stopped it (a diverged run: the plain mean's fate)
                print(f"{name}: {e}", file=sys.stderr)
                return {
                    "name": name,
                    "eval_after": float("nan"),
                    "rounds": 0,
                    "rounds_with_left_out": 0,
                    "rounds_without_all": 0,
                    "first_named": None,
                }
    records = read_metrics(run_dir)
    summary = next(r for r in records if r["type"] == "summary")
    rounds = [r for r in records if r["type"] == "round"]
    return {
        "name": name,
        "eval_after": summary["eval_after"],
        "rounds": len(rounds),
        "rounds_with_left_out": sum(1 for r in rounds if r.get("left_out")),
        "rounds_without_all": sum(1 for r in rounds if r["num_contributors"] < workers),
        "first_named": next((r["round"] for r in rounds if r.get("left_out")), None),
    }


def _worker(args: argparse.Namespace) -> None:
    """One torchrun rank of a gloo run (the last rank is the insider), or one hivemind peer (``--attack``: its own)."""
    attack = None if args.attack == "None" else args.attack
    config = build_config(overrides=args.set)
    run_dir = Path(args.out) / args.worker
    if "WORLD_SIZE" in os.environ:
        train(config, run_dir, show_progress=False, wrap=_wrap(attack, int(os.environ["WORLD_SIZE"]) - 1))
    else:
        if attack in RELAYS:
            train(config, run_dir, show_progress=False, create=_relaying(attack))
            return
        insider = None if attack is None else (lambda t: Insider(t, attack))
        train(config, run_dir, show_progress=False, wrap=insider)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/insider")
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker (train.steps)")
    p.add_argument("--merge", default="robust", choices=["robust", "mean"], help="diloco.merge")
    p.add_argument("--transport", default="inprocess", choices=["inprocess", "torch", "hivemind"])
    p.add_argument("--workers", type=int, default=3, help="workers with the insider (the honest baseline: one fewer)")
    p.add_argument(
        "--attacks",
        default="x1e6,x-1e6,x-10",
        help="comma-separated, one run each: x<scale> (its pseudo-gradient times scale), or a forged control value: "
        "work=<w - 1>, valid=<flag>, digest=<h> (e.g. work=-2.9999,valid=-2,digest=3.5); "
        "hivemind: relay, reducer-100 (a part's owner that relays what it likes, RELAYS)",
    )
    p.add_argument(
        "--late",
        type=float,
        default=0.0,
        help="hivemind: the insider starts second and the other honest peers this many seconds later "
        "(a group of two, the founder and the insider, at the start)",
    )
    p.add_argument("--port", type=int, default=29517, help="torchrun's rendezvous port (--transport torch)")
    p.add_argument("--set", action="append", default=[], help="a further trainer override, key=value")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--attack", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    tag = f"{args.transport}-{args.merge}" + (f"-late{args.late:g}" if args.late else "")
    honest = args.workers - 1
    rows = [run(args, name=f"{tag}-honest{honest}", workers=honest, attack=None)]
    attacks = args.attacks.split(",")
    rows += [run(args, name=f"{tag}-insider{a.replace('=', '')}", workers=args.workers, attack=a) for a in attacks]
    base = rows[0]["eval_after"]
    print(
        f"| run | eval loss | vs the {honest} honest alone | rounds with a contribution left out or named "
        "| first round naming it | with fewer contributors |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:  # fewer contributors: someone missing from the group (on hivemind: the insider, once benched)
        print(
            f"| {r['name']} | {r['eval_after']:.4f} | {r['eval_after'] / base - 1:+.2%} "
            f"| {r['rounds_with_left_out']}/{r['rounds']} | {r['first_named']} "
            f"| {r['rounds_without_all']}/{r['rounds']} |"
        )
    worst = max(r["eval_after"] / base - 1 if r["eval_after"] == r["eval_after"] else float("inf") for r in rows[1:])
    print(f"worst insider run: {worst:+.2%} against the honest workers alone (target: <= +2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

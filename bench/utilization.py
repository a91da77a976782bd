"""The utilization benchmark: how much of a worker's wall time is compute, per overlap mode, on a slow link.

Not part of the test run. Two gloo workers (``diloco torchrun --nproc-per-node=2``, one torch thread each on
this 2-core machine) train the same model in each mode: DiLoCo blocking (``diloco.overlap=none``), streaming
(``fragments``, ``overlap_steps``), eager, and DDP (``train.mode=ddp``). Each mode runs over two links of the
same rate (``--transport hivemind``: two hivemind peers instead, ``bench/hivemind_pair.py``, no DDP):

- ``shaped``: the workers run inside ``bench/shaped_link.sh RATE`` (a network namespace whose loopback is
  shaped with ``tc tbf``; root only). Both directions of both workers share that one queue.
- ``simulated``: plain loopback behind the simulated link (``[transport] link_mbit``, ``link_latency_ms``):
  each worker has its own full-duplex link of that rate.
- ``simulated-shared`` (optional): the simulated link at half the rate, what one shared queue gives each of
  two workers sending at once (the shaped link's model).

Utilization = useful compute / wall, per run, rank 0's (the trainer's metrics.jsonl is rank 0's only):
compute = steps x the median over steps of the step's compute seconds (a step's wall time minus the reduce
it waited for; most DiLoCo steps wait for none), wall = the training loop's seconds up to the last step
(``time_s`` of the last step record: no final eval or checkpoint; evals only at the end). "Steady" is the
same up to the last multiple of H before the end: without the end of training, where the overlap modes wait
for their last reduces with nothing left to hide them behind (``DiLoCo.flush``). The trainer's own figure
(summary ``utilization``: compute / wall, each step's compute its wall minus what it waited for) is shown
beside it; before main's be505f8 it subtracted a reduce's whole ``seconds`` (mostly behind compute in the
overlap modes) and understated them; since, it counts the end-of-training flush as compute. A run already finished in ``--out`` is read, not rerun.

    sudo true; PYTHONPATH=src python bench/utilization.py --out runs/utilization          # about 7 minutes
    PYTHONPATH=src python bench/utilization.py --out runs/util --links simulated --modes blocking,ddp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["LINKS", "MODES", "command", "main", "measure", "table"]

HERE = Path(__file__).resolve().parent
LINKS = ("shaped", "simulated", "simulated-shared")
MODES = ("blocking", "streaming", "eager", "ddp")


def mode_settings(mode: str, *, inner_steps: int, fragments: int, overlap_steps: int) -> list[str]:
    if mode == "blocking":
        return ["train.mode=diloco", "diloco.overlap=none"]
    if mode == "streaming":
        return [
            "train.mode=diloco",
            "diloco.overlap=streaming",
            f"diloco.fragments={fragments}",
            f"diloco.overlap_steps={overlap_steps}",
        ]
    if mode == "eager":
        return ["train.mode=diloco", "diloco.overlap=eager"]
    if mode == "ddp":
        return ["train.mode=ddp"]
    raise ValueError(f"mode={mode!r} is invalid: expected one of {list(MODES)}")


def command(*, link: str, mode: str, run_dir: Path, args: argparse.Namespace) -> list[str]:
    """The command line of one run."""
    steps = args.ddp_steps if mode == "ddp" else args.steps
    sets = [
        "transport.kind=torch",
        f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={args.intermediate}",
        f"model.num_layers={args.layers}",
        f"train.steps={steps}",
        f"train.batch_size={args.batch}",
        f"train.eval_every={steps}",
        "train.eval_batches=1",
        "train.checkpoint_every=0",
        "train.ddp_warm_start=0",
        "train.warmup_steps=5",
        f"diloco.inner_steps={args.inner_steps}",
        f"diloco.codec={args.wire}",
        f"train.runs_dir={json.dumps(str(run_dir.parent))}",
        *mode_settings(mode, inner_steps=args.inner_steps, fragments=args.fragments, overlap_steps=args.overlap_steps),
        *args.extra,
    ]
    if link.startswith("simulated"):
        rate = args.rate / 2 if link == "simulated-shared" else args.rate
        sets += [f"transport.link_mbit={rate:g}", f"transport.link_latency_ms={args.latency_ms:g}"]
    if args.transport == "hivemind":  # two peers, the joiner measured (bench/hivemind_pair.py)
        sets = [s for s in sets if not s.startswith(("transport.kind=", "train.runs_dir="))]
        cmd = [
            sys.executable,
            str(HERE / "hivemind_pair.py"),
            "--runs-dir",
            str(run_dir.parent),
            "--name",
            run_dir.name,
        ]
        cmd += ["--", *sets]
    else:
        cmd = [sys.executable, "-m", "diloco_train.cli", "torchrun", "--standalone", "--nproc-per-node=2"]
        cmd += ["train", "-q", "--name", run_dir.name]
        for s in sets:
            cmd += ["--set", s]
    if link == "shaped":
        cmd = [str(HERE / "shaped_link.sh"), f"{args.rate:g}mbit", *cmd]
    return cmd


def measure(run_dir: Path, *, inner_steps: int) -> dict[str, Any] | None:
    """Rank 0's figures of a finished run (None if it has not finished). ``steady_utilization``: the same up
    to the last multiple of ``inner_steps`` before the end, without the end of training, where the overlap
    modes wait for the last reduces with nothing left to hide them behind (DiLoCo.flush; DDP: the whole run)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summary = next((r for r in records if r["type"] == "summary"), None)
    steps = [r for r in records if r["type"] == "step"]
    if summary is None or not steps:
        return None
    rounds = [r for r in records if r["type"] == "round"]
    syncs = rounds or [s for s in steps if s["bytes_sent"]]  # DDP: every step's gradient reduce
    per_step = statistics.median(s["compute_s"] for s in steps)
    wall = steps[-1]["time_s"]
    cut = (len(steps) - 1) // inner_steps * inner_steps if rounds else len(steps)
    steady = cut * per_step / steps[cut - 1]["time_s"] if cut else math.nan
    return {
        "steps": len(steps),
        "wall_s": wall,
        "compute_s_per_step": per_step,
        "utilization": len(steps) * per_step / wall,
        "steady_steps": cut,
        "steady_utilization": steady,
        "trainer_utilization": summary["utilization"],
        "syncs": len(syncs),
        "peak_bytes_per_sync": max((s["bytes_sent"] for s in syncs), default=0),
        "bytes_sent": summary["bytes_sent"],
        "eval_after": summary["eval_after"],
    }


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        f"rate {args.rate:g} Mbit/s, latency {args.latency_ms:g} ms; model {args.hidden}x{args.layers} "
        f"(intermediate {args.intermediate}), batch {args.batch}x64, H={args.inner_steps}, wire {args.wire}; "
        f"streaming P={args.fragments}, tau={args.overlap_steps}; "
        + (
            "rank 0's figures\n\n"
            if getattr(args, "transport", "torch") == "torch"
            else "hivemind, the joining peer's figures\n\n"
        )
    )
    lines = [
        "| link | mode | steps | wall s | compute s/step | utilization | steady (steps) | trainer's figure | syncs | peak MB/sync |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        link, mode = name.split("/")
        lines.append(
            f"| {link} | {mode} | {r['steps']} | {r['wall_s']:.1f} | {r['compute_s_per_step']:.3f} | "
            f"{100 * r['utilization']:.1f}% | {100 * r['steady_utilization']:.1f}% ({r['steady_steps']}) | "
            f"{100 * r['trainer_utilization']:.1f}% | {r['syncs']} | "
            f"{r['peak_bytes_per_sync'] / 1e6:.2f} |"
        )
    diffs = []
    for sim in ("simulated", "simulated-shared"):
        for mode in MODES:
            a, b = results.get(f"{sim}/{mode}"), results.get(f"shaped/{mode}")
            if a and b:
                cells = [
                    f"{100 * a[k]:.1f}% | {100 * b[k]:.1f}% | {100 * (a[k] - b[k]):+.1f}"
                    for k in ("utilization", "steady_utilization")
                ]
                diffs.append(f"| {sim} | {mode} | {' | '.join(cells)} |")
    if diffs:
        lines += [
            "",
            "| prediction | mode | predicted | shaped | difference (points) | steady: predicted | shaped | difference |",
            "|---|---|---|---|---|---|---|---|",
            *diffs,
        ]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--links", default="shaped,simulated", help=f"comma-separated, of {list(LINKS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--rate", type=float, default=100.0, help="link rate in Mbit/s")
    p.add_argument("--latency-ms", type=float, default=0.0, help="the simulated link's latency per reduce")
    p.add_argument("--steps", type=int, default=60, help="inner steps of the DiLoCo runs")
    p.add_argument("--ddp-steps", type=int, default=10, help="steps of the DDP runs (a sync every step)")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--transport", default="torch", choices=("torch", "hivemind"), help="hivemind: two peers, no DDP")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap-steps", type=int, default=4)
    p.add_argument("--wire", default="fp32")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument(
        "--layers", type=int, default=8, help="blocks (streaming's fragments are P of them each: P | layers)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="extra",
        help="another trainer setting of every run (repeatable; before the simulated link's, which win)",
    )
    args = p.parse_args(argv)
    links, modes = args.links.split(","), args.modes.split(",")
    for what, names, valid in (("links", links, LINKS), ("modes", modes, MODES)):
        bad = sorted(set(names) - set(valid))
        if bad:
            p.error(f"--{what}: {bad} invalid, expected some of {list(valid)}")
    if args.transport == "hivemind" and "ddp" in modes:
        p.error("--modes: ddp runs on torch only; leave it out with --transport hivemind")
    if "shaped" in links and os.geteuid() != 0:
        p.error("--links shaped needs root (ip netns, tc); leave it out or run as root")
    args.out.mkdir(parents=True, exist_ok=True)
    for link in links:
        for mode in modes:
            run_dir = args.out / f"{link}-{mode}"
            if measure(run_dir, inner_steps=args.inner_steps) is not None:
                continue
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            cmd = command(link=link, mode=mode, run_dir=run_dir, args=args)
            print(f"== {link}/{mode}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            print(f"   {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    results = {}
    for link in LINKS:  # every finished run in --out, also of earlier invocations
        for mode in MODES:
            r = measure(args.out / f"{link}-{mode}", inner_steps=args.inner_steps)
            if r is not None:
                results[f"{link}/{mode}"] = r
    text = table(results, args)
    (args.out / "utilization.md").write_text(text)
    (args.out / "utilization.json").write_text(
        json.dumps({"settings": vars(args) | {"out": str(args.out)}, "runs": results}, indent=1)
    )
    plot(results, args.out / "utilization.png")
    print(text)
    return 0


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Utilization per mode, one group of bars per link (the table's figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = [link for link in LINKS if any(k.startswith(f"{link}/") for k in results)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        values = [100 * results.get(f"{link}/{mode}", {}).get("utilization", float("nan")) for link in links]
        ax.bar([x + i * width for x in range(len(links))], values, width, label=mode)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(links))], links)
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 115)
    ax.axhline(95, color="grey", lw=0.5, ls="--")
    ax.legend(fontsize=8, ncol=len(MODES), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

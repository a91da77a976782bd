"""The convergence benchmark: single worker, DDP and DiLoCo (M = 1, 2, 4) at equal steps and per-worker batch.

Not part of the test run. Protocol: every run takes the same number of inner steps with the same batch
per worker, learning-rate schedule and model, on the embedded corpus (the interpreter's standard
library, bytes); DDP and DiLoCo with M workers therefore see M times the tokens of ``single``. DDP
averages gradients every step; DiLoCo averages pseudo-gradients every ``--inner-steps`` steps, with
the trainer's defaults for everything not given (outer lr by the number of workers). Every run is
repeated with each seed (weights and data order); the table gives the mean and the spread (max - min)
over seeds of the final eval loss, the bytes sent per worker, the traffic against DDP and the wall
time, then checks the convergence targets. A run already finished in ``--out`` is read, not rerun, so
an interrupted benchmark continues where it stopped.

    python bench/convergence.py --out runs/convergence            # the full table (docs/results.md)
    python bench/convergence.py --quick --out runs/convergence-q  # a smoke check, about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco_train.report.plot import read_metrics
from diloco_train.run_config import build_config
from diloco_train.train import train

__all__ = ["RUNS", "Outcome", "main", "protocol", "run_one", "table", "verdicts"]

# name -> (mode, workers)
RUNS: dict[str, tuple[str, int]] = {
    "single": ("single", 1),
    "ddp-4": ("ddp", 4),
    "diloco-1": ("diloco", 1),
    "diloco-2": ("diloco", 2),
    "diloco-4": ("diloco", 4),
    "streaming-4": ("diloco", 4),
    "eager-4": ("diloco", 4),
}

OVERLAP: dict[str, list[str]] = {
    "streaming-4": [
        "diloco.overlap=streaming",
        "diloco.fragments=2",
        "diloco.overlap_steps=1",  # merge_alpha 0: 0.5 ended +0.8% (tau 1 and 2) against -0.3% at 0 (seed 0)
    ],
    "eager-4": ["diloco.overlap=eager"],
}
"""The overlap runs' settings (docs/overlap.md); they are judged against diloco-4, same seeds and H."""


@dataclass(frozen=True)
class Outcome:
    name: str
    seed: int
    eval_loss: float
    bytes_sent: int
    """Bytes rank 0 sent (every worker sends the same)."""
    wall_seconds: float
    rounds: int
    agreement: float
    """Mean over the run's rounds of the workers' agreement (NaN without rounds)."""


def run_one(
    *, name: str, mode: str, workers: int, seed: int, out: Path, overrides: list[str], verbose: bool = True
) -> Outcome:
    """Train one configuration (or read it back if ``out / name-sSEED`` holds a finished run)."""
    run_dir = out / f"{name}-s{seed}"
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if not any(r.get("type") == "summary" for r in records):
        if run_dir.exists():  # an interrupted run: start it again from scratch
            import shutil

            shutil.rmtree(run_dir)
        config = build_config(
            overrides=[
                f"train.mode={mode}",
                f"train.workers={workers}",
                f"train.seed={seed}",
                "train.checkpoint_every=0",
                f"train.runs_dir={json.dumps(str(out))}",
                *overrides,
            ]
        )
        if verbose:
            print(f"== {run_dir.name}: {' '.join(overrides)}", file=sys.stderr, flush=True)
        train(config, run_dir, show_progress=False)
        records = read_metrics(run_dir)
    summary = next(r for r in records if r.get("type") == "summary")
    rounds = [r for r in records if r.get("type") == "round"]
    agreement = statistics.fmean(r["agreement"] for r in rounds) if rounds and "agreement" in rounds[0] else math.nan
    return Outcome(
        name=name,
        seed=seed,
        eval_loss=summary["eval_after"],
        bytes_sent=summary["bytes_sent"],
        wall_seconds=summary["wall_s"],
        rounds=len(rounds),
        agreement=agreement,
    )


def protocol(*, steps: int, inner_steps: int, seq_len: int, batch: int) -> list[str]:
    """The trainer overrides every run of the protocol shares (eval every tenth of the run, 32 batches; an
    fp32 wire and no warm start unless a run adds one, whatever the trainer's defaults)."""
    return [
        "diloco.codec=fp32",
        "train.ddp_warm_start=0",
        f"train.steps={steps}",
        f"diloco.inner_steps={inner_steps}",
        f"data.seq_len={seq_len}",
        f"train.batch_size={batch}",
        f"train.eval_every={max(steps // 10, 1)}",
        "train.eval_batches=32",
    ]


def _stats(values: list[float]) -> tuple[float, float]:
    """Mean and spread (max - min)."""
    return statistics.fmean(values), max(values) - min(values)


def table(outcomes: list[Outcome], names: list[str]) -> tuple[str, dict[str, dict[str, float]]]:
    """The Markdown table and, per run name, its aggregated figures."""
    agg: dict[str, dict[str, float]] = {}
    for name in names:
        mine = [o for o in outcomes if o.name == name]
        loss, spread = _stats([o.eval_loss for o in mine])
        agg[name] = {
            "eval_loss": loss,
            "spread": spread,
            "bytes": statistics.fmean(o.bytes_sent for o in mine),
            "wall": statistics.fmean(o.wall_seconds for o in mine),
            "rounds": statistics.fmean(o.rounds for o in mine),
            "agreement": statistics.fmean(o.agreement for o in mine),
            "seeds": len(mine),
        }
    ddp = agg.get("ddp-4", {}).get("bytes", 0.0)
    lines = [
        (
            "| run | seeds | eval loss (mean) | spread | perplexity | MB sent / worker | traffic vs DDP | rounds "
            "| agreement | wall s |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in agg.items():
        traffic = "-" if not a["bytes"] or not ddp else f"1/{ddp / a['bytes']:.1f}"
        agree = "-" if math.isnan(a["agreement"]) else f"{a['agreement']:.3f}"
        lines.append(
            f"| {name} | {a['seeds']} | {a['eval_loss']:.4f} | {a['spread']:.4f} | {math.exp(a['eval_loss']):.3f} "
            f"| {a['bytes'] / 1e6:.1f} | {traffic} | {a['rounds']:.0f} | {agree} | {a['wall']:.0f} |"
        )
    return "\n".join(lines) + "\n", agg


def verdicts(agg: dict[str, dict[str, float]]) -> list[str]:
    """The convergence targets, each with its figure and PASS or MISS."""
    out = []
    if {"single", "ddp-4", "diloco-4"} <= set(agg):
        single, ddp, d4 = (agg[n]["eval_loss"] for n in ("single", "ddp-4", "diloco-4"))
        recovered = (single - d4) / (single - ddp) if single != ddp else math.nan
        above = d4 / ddp - 1
        out.append(
            f"diloco-4 recovers {100 * recovered:.0f}% of DDP's gain over single (target >= 50%): "
            + ("PASS" if recovered >= 0.5 else "MISS")
        )
        out.append(
            f"diloco-4 ends {100 * above:+.2f}% against DDP's eval loss (target <= +5%): "
            + ("PASS" if above <= 0.05 else "MISS")
        )
        gap = min(abs(d4 - ddp), abs(single - d4))
        worst = max(agg[n]["spread"] for n in ("single", "ddp-4", "diloco-4"))
        if agg["diloco-4"]["seeds"] > 1:
            out.append(
                f"largest seed spread {worst:.4f} vs the smallest gap claimed {gap:.4f}: "
                + ("PASS" if worst < gap else "MISS")
            )
        else:
            out.append("seed spread: n/a with one seed")
        if agg["diloco-4"]["bytes"]:
            out.append(f"diloco-4 sends {agg['ddp-4']['bytes'] / agg['diloco-4']['bytes']:.1f}x less than DDP")
    for name, target in (("streaming-4", 0.005), ("eager-4", 0.03)):
        if {name, "diloco-4"} <= set(agg):
            worse = agg[name]["eval_loss"] / agg["diloco-4"]["eval_loss"] - 1
            out.append(
                f"{name} ends {100 * worse:+.2f}% against diloco-4 (target <= +{100 * target:g}%): "
                + ("PASS" if worse <= target else "MISS")
            )
    if {"single", "diloco-1"} <= set(agg):
        worse = agg["diloco-1"]["eval_loss"] / agg["single"]["eval_loss"] - 1
        out.append(
            f"diloco-1 ends {100 * worse:+.2f}% against single (target <= +0.5%): "
            + ("PASS" if worse <= 0.005 else "MISS")
        )
    return out


def overlay_ylim(curves: list[list[float]]) -> tuple[float, float]:
    """The overlay's y range: the curves' values after their first tenth (the first drop from the initial
    loss would squash the rest, where the runs differ), with a 5% margin."""
    kept = [v for c in curves for v in c[max(1, -(-len(c) // 10)) :]] or [v for c in curves for v in c]
    low, high = min(kept), max(kept)
    margin = 0.05 * (high - low) or 0.05
    return low - margin, high + margin


def plot(out: Path, names: list[str], seeds: list[int], path: Path) -> tuple[float, float]:
    """Eval loss per run name (mean over seeds, band = min..max) and, below, the DiLoCo runs' agreement; the
    loss panel's y range is returned."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 1))
    bands: list[list[float]] = []  # each run's band edges: the y range is theirs
    for name in names:
        curves, agree = [], []
        for seed in seeds:
            records = read_metrics(out / f"{name}-s{seed}")
            curves.append([(r["step"], r["loss"]) for r in records if r.get("type") == "eval"])
            agree.append(
                [(r["step"], r["agreement"]) for r in records if r.get("type") == "round" and "agreement" in r]
            )
        steps = [s for s, _ in curves[0]]
        values = [[v for _, v in c] for c in curves]
        mean = [statistics.fmean(col) for col in zip(*values)]
        (line,) = ax.plot(steps, mean, "o-", ms=3, label=name)
        bands += [[min(c) for c in zip(*values)], [max(c) for c in zip(*values)]]
        ax.fill_between(steps, bands[-2], bands[-1], color=line.get_color(), alpha=0.2)
        if agree[0]:
            ax2.plot(
                [s for s, _ in agree[0]],
                [statistics.fmean(c) for c in zip(*[[v for _, v in a] for a in agree])],
                color=line.get_color(),
                lw=1,
                label=name,
            )
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_ylim(*overlay_ylim(bands))
    ax.set_title(f"{out.name}: mean over seeds {seeds} (band: min..max)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax2.set_ylabel("agreement")
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("step (per worker)")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ax.get_ylim()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/convergence", help="folder for the runs, table.md, results.json, overlay.png")
    p.add_argument("--steps", type=int, default=1100, help="inner steps per worker in every run")
    p.add_argument("--inner-steps", type=int, default=10, help="DiLoCo's H")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument(
        "--runs", default=",".join(n for n in RUNS if n not in OVERLAP), help=f"comma-separated subset of {list(RUNS)}"
    )
    p.add_argument("--seq-len", type=int, default=64, help="window length in bytes (data.seq_len)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step per worker (train.batch_size)")
    p.add_argument("--warm-start", type=int, default=100, help="DiLoCo runs: DDP steps before the first round")
    p.add_argument("--quick", action="store_true", help="smoke check: 100 steps, H = 10, one seed")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        help="extra trainer overrides for every run (e.g. model.preset=150m on a GPU)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.inner_steps, args.seeds, args.warm_start = 100, 10, "0", 20
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.runs.split(",")
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        p.error(f"unknown run(s) {unknown}; valid: {list(RUNS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [*protocol(steps=args.steps, inner_steps=args.inner_steps, seq_len=args.seq_len, batch=args.batch_size)]
    start = time.perf_counter()
    outcomes = []
    for seed in seeds:  # seed-major: after the first pass every run has one seed, for an early look
        for name in names:
            mode, workers = RUNS[name]
            extra = [f"train.ddp_warm_start={args.warm_start}"] if mode == "diloco" and args.warm_start else []
            extra += OVERLAP.get(name, [])
            overrides = common + extra + args.overrides  # --set wins over a run's own settings
            outcomes.append(run_one(name=name, mode=mode, workers=workers, seed=seed, out=out, overrides=overrides))
    text, agg = table(outcomes, names)
    checks = verdicts(agg)
    header = (
        f"{args.steps} steps per worker, batch {args.batch_size} x {args.seq_len} bytes, H = {args.inner_steps}, "
        f"DiLoCo after {args.warm_start} DDP steps, seeds {seeds}, "
        f"overrides {args.overrides or 'none'}; this invocation took {time.perf_counter() - start:.0f} s\n\n"
    )
    report = header + text + "\n" + "\n".join(f"- {c}" for c in checks) + "\n"
    (out / "table.md").write_text(report)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": agg, "checks": checks}, indent=2))
    plot(out, names, seeds, out / "overlay.png")
    print(report)
    print(f"written: {out / 'table.md'}, {out / 'results.json'}, {out / 'overlay.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The goodput benchmark: lock-step against elastic rounds, with workers of equal and of different speeds.

Not part of the test run. Four in-process workers train the default model (``diloco train``'s defaults: int4,
H = 10, the robust merge; no DDP warm start, no checkpoints) for the same run length in nominal steps
(``--steps``: the same rounds and learning-rate schedule), evaluating after every round:

- ``lock``: a round every ``inner_steps`` steps on every worker; the fast ones wait for the slowest.
- ``elastic``: ``diloco.round_seconds`` (``--round-seconds``): each worker takes the steps it manages in that
  time, and the merge weighs each contribution by its steps (docs/elastic.md).

Speeds: ``homogeneous`` (every worker at 1) and ``heterogeneous`` (``--speeds``, default 1, 1, 0.5, 0.25: each
worker waits (1/speed - 1) x its step's compute, ``train.speeds``). Per run: goodput (the workers' busy
seconds over 4 x the training loop's wall, the trainer's summary), the final eval loss, the wall time. Per
seed and speeds: the time elastic took to first evaluate at or below lock-step's final loss, over lock-step's
wall time, and elastic's eval loss at lock-step's wall time (its last eval by then) against lock-step's final.
A run already finished in ``--out`` is read, not rerun.

    PYTHONPATH=src python bench/goodput.py --out runs/goodput           # 12 runs, about 30 minutes
    PYTHONPATH=src python bench/goodput.py --out runs/goodput-q --quick # 2 runs, 60 steps, about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco_train.report.plot import read_metrics
from diloco_train.run_config import build_config
from diloco_train.train import train

__all__ = ["Run", "compare", "main", "run_one", "table"]

MODES = ("lock", "elastic")
SPEEDS = ("homogeneous", "heterogeneous")


@dataclass(frozen=True)
class Run:
    mode: str
    speeds: str
    seed: int
    goodput: float
    wall: float
    eval_loss: float
    curve: tuple[tuple[float, float], ...]
    """(seconds into the training loop, eval loss) of every eval."""
    rounds: int
    left_out: int
    """Contributions the robust merge left out over the run (rank 0's view)."""


def run_one(*, mode: str, speeds: str, seed: int, out: Path, overrides: list[str]) -> Run:
    """Train one configuration (or read it back from ``out / MODE-SPEEDS-sSEED`` if it finished)."""
    run_dir = out / f"{mode}-{speeds}-s{seed}"
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if not any(r.get("type") == "summary" for r in records):
        if run_dir.exists():  # an interrupted run: again from scratch
            shutil.rmtree(run_dir)
        config = build_config(overrides=[*overrides, f"train.seed={seed}", f"train.runs_dir={json.dumps(str(out))}"])
        print(f"== {run_dir.name}: {' '.join(overrides)}", file=sys.stderr, flush=True)
        train(config, run_dir, show_progress=False)
        records = read_metrics(run_dir)
    summary = next(r for r in records if r.get("type") == "summary")
    rounds = [r for r in records if r.get("type") == "round"]
    return Run(
        mode=mode,
        speeds=speeds,
        seed=seed,
        goodput=summary["goodput"],
        wall=summary["wall_s"],
        eval_loss=summary["eval_after"],
        curve=tuple((r["time_s"], r["loss"]) for r in records if r.get("type") == "eval"),
        rounds=len(rounds),
        left_out=sum(len(r.get("left_out", [])) for r in rounds),
    )


def compare(lock: Run, elastic: Run) -> tuple[float, float]:
    """(elastic's time to lock-step's final eval loss over lock-step's wall: inf if never, elastic's eval loss at
    lock-step's wall time minus lock-step's final)."""
    reached = [t for t, loss in elastic.curve if loss <= lock.eval_loss]
    by_then = [loss for t, loss in elastic.curve if t <= lock.wall]
    ratio = min(reached) / lock.wall if reached else float("inf")
    return ratio, by_then[-1] - lock.eval_loss


def _stats(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} (spread {max(values) - min(values):.3f})"


def table(runs: list[Run]) -> str:
    lines = [
        "| speeds | mode | seeds | goodput | final eval loss | wall s | rounds | left out |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for speeds in SPEEDS:
        for mode in MODES:
            rs = [r for r in runs if r.mode == mode and r.speeds == speeds]
            if not rs:
                continue
            lines.append(
                f"| {speeds} | {mode} | {len(rs)} | {_stats([r.goodput for r in rs])} | "
                f"{_stats([r.eval_loss for r in rs])} | {_stats([r.wall for r in rs])} | "
                f"{statistics.fmean(r.rounds for r in rs):.0f} | {sum(r.left_out for r in rs)} |"
            )
    pair_header = (
        "| speeds | seed | elastic's time to lock-step's final loss / lock-step's wall "
        "| elastic's eval loss at lock-step's wall - lock-step's final |"
    )
    lines += ["", pair_header, "|---|---|---|---|"]
    for speeds in SPEEDS:
        for seed in sorted({r.seed for r in runs}):
            pair = {r.mode: r for r in runs if r.speeds == speeds and r.seed == seed}
            if len(pair) == 2:
                ratio, delta = compare(pair["lock"], pair["elastic"])
                lines.append(f"| {speeds} | {seed} | {ratio:.3f} | {delta:+.4f} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], path: Path) -> None:
    """Eval loss against wall time, one line per run (heterogeneous on the left, homogeneous on the right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, speeds in zip(axes, ("heterogeneous", "homogeneous")):
        for r in runs:
            if r.speeds == speeds:
                style = "-" if r.mode == "elastic" else "--"
                color = "tab:green" if r.mode == "elastic" else "tab:red"
                label = f"{r.mode}" if r.seed == min(x.seed for x in runs) else None
                ax.plot([t for t, _ in r.curve], [v for _, v in r.curve], style, color=color, alpha=0.8, label=label)
        ax.set_title(f"{speeds} speeds")
        ax.set_xlabel("wall seconds of the training loop")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes[0].set_ylabel("eval loss (nats/byte)")
    axes[0].set_ylim(top=3.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/goodput", help="folder for the runs, table.md and goodput.png")
    p.add_argument("--steps", type=int, default=200, help="nominal steps of every run (rounds x inner_steps)")
    p.add_argument("--round-seconds", type=float, default=5.0, help="elastic: diloco.round_seconds")
    p.add_argument("--speeds", default="1,1,0.5,0.25", help="the heterogeneous workers' speeds")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--which", default="heterogeneous,homogeneous", help=f"comma-separated subset of {SPEEDS}")
    p.add_argument("--quick", action="store_true", help="smoke check: 60 steps, one seed, heterogeneous only")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.which = 60, "0", "heterogeneous"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["train.workers=4", f"train.steps={args.steps}", "train.ddp_warm_start=0", "train.checkpoint_every=0"]
    speeds = {"homogeneous": [], "heterogeneous": [f"train.speeds=[{args.speeds}]"]}
    modes = {"lock": [], "elastic": [f"diloco.round_seconds={args.round_seconds}"]}
    start, runs = time.perf_counter(), []
    for seed in (int(s) for s in args.seeds.split(",")):
        for which in args.which.split(","):
            for mode in MODES:
                overrides = common + speeds[which] + modes[mode]
                runs.append(run_one(mode=mode, speeds=which, seed=seed, out=out, overrides=overrides))
    header = (
        f"{args.steps} nominal steps, 4 in-process workers, the trainer's defaults, heterogeneous speeds "
        f"{args.speeds}, elastic round_seconds={args.round_seconds}; this invocation took "
        f"{time.perf_counter() - start:.0f} s\n\n"
    )
    text = header + table(runs)
    (out / "table.md").write_text(text)
    plot(runs, out / "goodput.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

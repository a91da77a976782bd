"""The DiLoCo paper's comparison at equal compute per worker: single worker, DDP and DiLoCo (4 workers).

Not part of the test run. Every mode takes the same number of steps with the same batch per worker on
the embedded corpus (the interpreter's standard library, bytes), so DDP and DiLoCo see 4x the tokens
of the single worker; DDP communicates every step, DiLoCo every ``--inner-steps``. Prints a Markdown
table (final eval loss and perplexity, bytes rank 0 sent, wall time) and writes an overlay plot.

    python bench/paper_table.py --steps 300 --inner-steps 50 --out runs/paper-table
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from diloco_train.config import build_config
from diloco_train.plot import plot_runs
from diloco_train.train import train

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps per worker in every mode")
    p.add_argument("--inner-steps", type=int, default=50, help="DiLoCo's H")
    p.add_argument("--workers", type=int, default=4, help="workers of ddp and diloco")
    p.add_argument("--out", default="runs/paper-table", help="folder for the three runs, table.md and overlay.png")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE",
                   help="extra overrides applied to every mode (e.g. model.preset=150m on a GPU)")
    p.add_argument("--modes", default="single,ddp,diloco", help="comma-separated subset of the modes")
    args = p.parse_args(argv)
    out = Path(args.out)
    rows = []
    for mode in args.modes.split(","):
        config = build_config(overrides=[
            f"train.mode={mode}", f"train.steps={args.steps}", f"train.workers={args.workers}",
            f"diloco.inner_steps={args.inner_steps}", f"train.runs_dir={out}", "train.checkpoint_every=0",
            *args.overrides,
        ])  # fmt: skip
        print(f"== {mode}", file=sys.stderr, flush=True)
        r = train(config, out / mode)
        workers = 1 if mode == "single" else args.workers
        rows.append((mode, workers, r.eval_after, math.exp(r.eval_after), r.bytes_sent, r.wall_seconds, r.compute_seconds))
    lines = [
        f"steps per worker: {args.steps}, H = {args.inner_steps} (diloco), eval loss before training: "
        f"{r.eval_before:.4f}",
        "",
        "| mode | workers | eval loss | perplexity | MB sent (rank 0) | wall s | compute utilization |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, workers, loss, ppl, sent, wall, compute in rows:
        lines.append(f"| {mode} | {workers} | {loss:.4f} | {ppl:.2f} | {sent / 1e6:.1f} | {wall:.0f} | {100 * compute / wall:.0f}% |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    plot_runs([out / m for m in args.modes.split(",")], out / "overlay.png")
    print(table)
    print(f"written: {out / 'table.md'}, {out / 'overlay.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""RDA against the plain mean as workers are added: DiLoCo with M workers on the convergence protocol.

Same protocol as ``bench/convergence.py``'s ``diloco-M`` rows (1100 steps, H = 10, 100 DDP warm-start steps, batch
16 per worker, seq 64, fp32 wire); per M and seed: the plain mean at the outer lr of the rule for M
(``outer_lr_for``: 0.6, 0.7, 0.8 for M = 2, 4, 8 at momentum 0.5) and RDA (``diloco.rda``) at each ``--rda-lr``
(one lr for every M: RDA keeps the step's length as M grows, so the rule's growth with M is not needed). A run
already finished in ``--out`` is read back, not rerun.

    python bench/rda_workers.py --out runs/rda --workers 2,4,8 --seeds 0 --rda-lr 0.5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import Outcome, protocol, run_one


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/rda")
    p.add_argument("--workers", default="2,4,8", help="comma-separated numbers of workers M")
    p.add_argument("--seeds", default="0")
    p.add_argument("--rda-lr", default="0.5", help="comma-separated outer lrs for RDA (the same for every M)")
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--warm-start", type=int, default=100)
    args = p.parse_args(argv)
    common = [
        *protocol(steps=args.steps, inner_steps=10, seq_len=64, batch=16),
        f"train.ddp_warm_start={args.warm_start}",
    ]
    rows: dict[str, list[str]] = {"mean": []}
    rows.update({f"rda-lr{lr}": ["diloco.rda=true", f"diloco.outer_lr={lr}"] for lr in args.rda_lr.split(",")})
    results: dict[tuple[int, str], list[Outcome]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for m in (int(w) for w in args.workers.split(",")):
            for row, extra in rows.items():
                name = f"diloco-{m}-{row}"
                o = run_one(
                    name=name, mode="diloco", workers=m, seed=seed, out=Path(args.out), overrides=common + extra
                )
                results.setdefault((m, row), []).append(o)
    lines = [
        "| M | merge (outer lr) | seeds | eval loss (mean) | per seed | vs the plain mean |",
        "|---|---|---|---|---|---|",
    ]
    for (m, row), outs in sorted(results.items()):
        loss = statistics.fmean(o.eval_loss for o in outs)
        plain = statistics.fmean(o.eval_loss for o in results[(m, "mean")])
        per_seed = ", ".join(f"{o.eval_loss:.4f}" for o in outs)
        what = "mean (the rule's)" if row == "mean" else f"rda ({row.removeprefix('rda-lr')})"
        lines.append(f"| {m} | {what} | {len(outs)} | {loss:.4f} | {per_seed} | {100 * (loss / plain - 1):+.2f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out, "table.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

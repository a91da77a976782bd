"""The sweep that picked the trainer's DiLoCo defaults: H x outer lr x outer momentum at M = 4, then levers.

Not part of the test run. One seed, the tiny model, ``--batch-size`` sequences of ``--seq-len`` bytes per
worker, ``--steps`` steps. It runs in stages, so that the grid is pruned by what the first stage
measured rather than by hand:

1. H = 10: every (outer lr, momentum) cell of ``--lrs`` x ``--momenta`` whose *effective* step
   ``lr / (1 - momentum)`` lies in [``--min-eff``, ``--max-eff``] (the others are reported as pruned);
2. H = 20 and 50: the ``--top`` best cells of stage 1;
3. levers on the best cell at H = 10: a larger per-worker batch (``--big-batch``, against single and
   DDP at that batch), a DDP warm start of ``--warm-start`` steps before DiLoCo, and both;
4. M = 1 and M = 2 at H = 10 over ``--small-m-lrs`` (momentum of the best cell), to fit the rule
   that chooses the outer lr by the number of workers;
5. the inner learning rate: single, DDP and DiLoCo M = 4 (H = 10, the ``--inner-lr-cells``) at each of
   ``--inner-lrs`` (the others ran at the trainer's 1e-3), so that every method is compared at its
   own best inner lr.

Writes sweep.md (tables, one per H), results.json and heatmap.png into ``--out``. Finished runs are
read back instead of rerun.

    python bench/sweep.py --out runs/sweep
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from convergence import Outcome, run_one

__all__ = ["main"]


def _name(m: int, h: int, lr: float, mom: float, extra: str = "") -> str:
    return f"m{m}-h{h}-lr{lr:g}-mom{mom:g}{extra}"


def _heatmap(
    cells: dict[tuple[int, float, float], float],
    lrs: list[float],
    momenta: list[float],
    path: Path,
    reference: dict[str, float],
    pruned: list[tuple[float, float]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = sorted({h for h, _, _ in cells})
    fig, axes = plt.subplots(1, len(hs), figsize=(4.2 * len(hs), 3.6), squeeze=False)
    values = list(cells.values())
    lo, hi = min(values), max(values)
    for k, (ax, h) in enumerate(zip(axes[0], hs)):
        grid = [[cells.get((h, lr, mom), math.nan) for lr in lrs] for mom in momenta]
        im = ax.imshow(grid, cmap="viridis_r", vmin=lo, vmax=hi, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                blank = "pruned" if (lrs[j], momenta[i]) in pruned else "not run"
                dark = not math.isnan(v) and v > (lo + hi) / 2  # dark cells get white text
                ax.text(
                    j,
                    i,
                    blank if math.isnan(v) else f"{v:.3f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="gray" if math.isnan(v) else ("white" if dark else "black"),
                )
        ax.set_xticks(range(len(lrs)), [f"{x:g}" for x in lrs])
        ax.set_yticks(range(len(momenta)), [f"{x:g}" for x in momenta])
        ax.set_xlabel("outer lr")
        if k == 0:
            ax.set_ylabel("outer momentum (Nesterov)")
        ax.set_title(f"M=4, H={h}: final eval loss", fontsize="medium")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    ref = ", ".join(f"{k} {v:.3f}" for k, v in reference.items())
    fig.suptitle(f"lower is better; {ref}", fontsize="small")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step per worker (stage 3 doubles it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lrs", default="0.4,0.7,1.0,1.4,2.0")
    p.add_argument("--momenta", default="0,0.5,0.9")
    p.add_argument("--min-eff", type=float, default=1.0, help="prune cells whose lr / (1 - momentum) is below this")
    p.add_argument("--max-eff", type=float, default=7.0, help="prune cells whose lr / (1 - momentum) is above this")
    p.add_argument("--hs", default="20,50", help="the H values of stage 2")
    p.add_argument("--top", type=int, default=2)
    p.add_argument("--big-batch", type=int, default=16)
    p.add_argument("--warm-start", type=int, default=60, help="DDP steps before DiLoCo (0: skip this lever)")
    p.add_argument("--small-m-lrs", default="0.5,0.7,1.0")
    p.add_argument("--inner-lrs", default="5e-4,2e-3")
    p.add_argument("--inner-lr-cells", default="0.7:0.5,1.0:0.5,1.4:0.5", help="outer lr:momentum pairs of stage 5")
    p.add_argument("--stages", default="1,2,3,4,5")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = {int(s) for s in args.stages.split(",")}
    lrs = [float(x) for x in args.lrs.split(",")]
    momenta = [float(x) for x in args.momenta.split(",")]
    common = [
        f"train.steps={args.steps}",
        f"data.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        f"train.eval_every={args.steps // 6}",
        "train.eval_batches=32",
    ]
    results: dict[str, Outcome] = {}

    def run(name: str, mode: str, workers: int, overrides: list[str]) -> Outcome:
        results[name] = run_one(
            name=name, mode=mode, workers=workers, seed=args.seed, out=out, overrides=common + overrides
        )
        print(f"{name}: eval loss {results[name].eval_loss:.4f}", file=sys.stderr, flush=True)
        return results[name]

    def diloco(m: int, h: int, lr: float, mom: float, extra: list[str] = (), suffix: str = "") -> Outcome:
        return run(
            _name(m, h, lr, mom, suffix),
            "diloco",
            m,
            [f"diloco.inner_steps={h}", f"diloco.outer_lr={lr}", f"diloco.outer_momentum={mom}", *extra],
        )

    reference = {"single": run("single", "single", 1, []).eval_loss, "ddp-4": run("ddp-4", "ddp", 4, []).eval_loss}
    cells: dict[tuple[int, float, float], float] = {}
    eff = {(lr, mom): round(lr / (1 - mom), 6) for mom in momenta for lr in lrs}  # 0.7 / 0.1 is 7.000000000000001
    pruned = [c for c, e in eff.items() if not args.min_eff <= e <= args.max_eff]
    kept = [c for c in eff if c not in pruned]
    if 1 in stages:
        for lr, mom in kept:
            cells[(10, lr, mom)] = diloco(4, 10, lr, mom).eval_loss
    best = sorted(kept, key=lambda c: cells.get((10, *c), math.inf))[: args.top]
    if 2 in stages:
        for h in (int(x) for x in args.hs.split(",")):
            for lr, mom in best:
                cells[(h, lr, mom)] = diloco(4, h, lr, mom).eval_loss
    levers = {}
    if 3 in stages and best:
        lr, mom = best[0]
        b = args.big_batch
        big = [f"train.batch_size={b}"]
        levers[f"batch {b}: single"] = run(f"single-b{b}", "single", 1, big).eval_loss
        levers[f"batch {b}: ddp-4"] = run(f"ddp-4-b{b}", "ddp", 4, big).eval_loss
        levers[f"batch {b}: diloco-4 H=10 lr {lr:g} mom {mom:g}"] = diloco(4, 10, lr, mom, big, f"-b{b}").eval_loss
        if args.warm_start:
            w = args.warm_start
            levers[f"DDP warm start {w} steps, then diloco-4 H=10 lr {lr:g} mom {mom:g}"] = diloco(
                4, 10, lr, mom, [f"train.ddp_warm_start={w}"], f"-warm{w}"
            ).eval_loss
            levers[f"batch {b} and DDP warm start {w} steps, then diloco-4 H=10 lr {lr:g} mom {mom:g}"] = diloco(
                4, 10, lr, mom, [*big, f"train.ddp_warm_start={w}"], f"-b{b}-warm{w}"
            ).eval_loss
    small_m = {}
    if 4 in stages and best:
        mom = best[0][1]
        for m in (1, 2):
            for lr in (float(x) for x in args.small_m_lrs.split(",")):
                small_m[(m, lr, mom)] = diloco(m, 10, lr, mom).eval_loss
    inner = {}
    if 5 in stages:
        for ilr in (float(x) for x in args.inner_lrs.split(",")):
            o = [f"train.lr={ilr}"]
            inner[f"single, inner lr {ilr:g}"] = run(f"single-ilr{ilr:g}", "single", 1, o).eval_loss
            inner[f"ddp-4, inner lr {ilr:g}"] = run(f"ddp-4-ilr{ilr:g}", "ddp", 4, o).eval_loss
            for cell in args.inner_lr_cells.split(","):
                lr, mom = (float(x) for x in cell.split(":"))
                inner[f"diloco-4 H=10 lr {lr:g} mom {mom:g}, inner lr {ilr:g}"] = diloco(
                    4, 10, lr, mom, o, f"-ilr{ilr:g}"
                ).eval_loss

    lines = [
        (
            f"{args.steps} steps per worker, batch {args.batch_size} x {args.seq_len} bytes, seed {args.seed}; "
            f"single {reference['single']:.4f}, ddp-4 {reference['ddp-4']:.4f}"
        ),
        "",
    ]
    for h in sorted({h for h, _, _ in cells}):
        lines += [
            f"M=4, H={h} (final eval loss; '-': pruned or not run)",
            "",
            "| momentum \\ outer lr | " + " | ".join(f"{x:g}" for x in lrs) + " |",
            "|---" * (len(lrs) + 1) + "|",
        ]
        for mom in momenta:
            row = [f"{cells[(h, lr, mom)]:.4f}" if (h, lr, mom) in cells else "-" for lr in lrs]
            lines.append(f"| {mom:g} | " + " | ".join(row) + " |")
        lines.append("")
    if pruned:
        lines.append(
            "pruned (effective step lr/(1-momentum) outside "
            f"[{args.min_eff:g}, {args.max_eff:g}]): " + ", ".join(f"lr {a:g} mom {b:g}" for a, b in pruned)
        )
        lines.append("")
    if levers:
        lines += ["| lever | eval loss |", "|---|---|", *(f"| {k} | {v:.4f} |" for k, v in levers.items()), ""]
    if small_m:
        lines += [
            "| M | outer lr | momentum | eval loss |",
            "|---|---|---|---|",
            *(f"| {m} | {lr:g} | {mom:g} | {v:.4f} |" for (m, lr, mom), v in small_m.items()),
            "",
        ]
    if inner:
        lines += ["| inner lr probe | eval loss |", "|---|---|", *(f"| {k} | {v:.4f} |" for k, v in inner.items()), ""]
    text = "\n".join(lines)
    (out / "sweep.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {
                "reference": reference,
                "cells": [[*k, v] for k, v in cells.items()],
                "levers": levers,
                "small_m": [[*k, v] for k, v in small_m.items()],
                "pruned": pruned,
                "inner_lr": inner,
            },
            indent=2,
        )
    )
    if cells:
        _heatmap(cells, lrs, momenta, out / "heatmap.png", reference, pruned)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

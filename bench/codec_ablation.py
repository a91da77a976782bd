"""The codec ablation: DiLoCo x4 of the convergence benchmark with each wire, error feedback on and off.

Same protocol, seeds and settings as ``bench/convergence.py``'s ``diloco-4`` row (its defaults: 1100
steps, H = 10, 100 DDP warm-start steps, batch 16, seq 64); only ``[diloco] codec`` and
``error_feedback`` change. The warm start's DDP gradients travel on the same wire
(``train.ddp_wire_dtype``, as the table in docs/results.md was measured). The fp32 row and DDP's traffic are read from the convergence
benchmark's folder (``--baseline``; ``diloco-4-sSEED`` and ``ddp-4-sSEED``), or run here if absent.
A run already finished in ``--out`` is read back, not rerun.

    python bench/codec_ablation.py --out runs/codecs --baseline runs/convergence
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import Outcome, protocol, run_one

from diloco_train.report.plot import read_metrics


def _wire(codec: str, *, rounds_ef: bool, ddp_ef: bool) -> list[str]:
    return [
        f"diloco.codec={codec}",
        f"train.ddp_wire_dtype={codec}",
        f"diloco.error_feedback={str(rounds_ef).lower()}",
        f"train.ddp_error_feedback={str(ddp_ef).lower()}",
    ]


TOPK = ["diloco.codec_block=4096", "diloco.codec_density=0.015625", "diloco.codec_value_bits=2"]
"""The sparse rows' codec: k = 64 of each block of 4096 values, 2-bit values (SparseLoCo's regime)."""

# name -> overrides. The int8 / int4 rows were measured before the warm start's DDP gradients had error
# feedback (train.ddp_error_feedback, on by default since): they keep it off, as measured.
CODECS: dict[str, list[str]] = {
    "fp32": [],
    "int8-ef": _wire("int8", rounds_ef=True, ddp_ef=False),
    "int8-noef": _wire("int8", rounds_ef=False, ddp_ef=False),
    "int4-ef": _wire("int4", rounds_ef=True, ddp_ef=False),
    "int4-noef": _wire("int4", rounds_ef=False, ddp_ef=False),
    "sign-ef": _wire("sign", rounds_ef=True, ddp_ef=True),
    "sign-noef": _wire("sign", rounds_ef=False, ddp_ef=False),
    # the warm start's gradients in int4 (AdamW on sign-coded gradients starts worse), the rounds' in sign
    "sign-ef-int4warm": [*_wire("sign", rounds_ef=True, ddp_ef=True), "train.ddp_wire_dtype=int4"],
    "sign-noef-int4warm": [*_wire("sign", rounds_ef=False, ddp_ef=True), "train.ddp_wire_dtype=int4"],
    # the warm start averages each worker's AdamW update instead of its gradient (train.warm_start_sync)
    "sign-ef-updateswarm": [*_wire("sign", rounds_ef=True, ddp_ef=True), "train.warm_start_sync=updates"],
    "sign-noef-updateswarm": [*_wire("sign", rounds_ef=False, ddp_ef=False), "train.warm_start_sync=updates"],
    # issue 31: sparse Top-k (2-bit values, 1/64 of each block of 4096 kept) and the dense 2-bit codec
    "topk-ef-int4warm": [*_wire("topk", rounds_ef=True, ddp_ef=True), *TOPK, "train.ddp_wire_dtype=int4"],
    "topk-ef-updateswarm": [*_wire("topk", rounds_ef=True, ddp_ef=True), *TOPK, "train.warm_start_sync=updates"],
    "topk-noef-updateswarm": [*_wire("topk", rounds_ef=False, ddp_ef=False), *TOPK, "train.warm_start_sync=updates"],
    "topk-ef-int4warm75": [
        *_wire("topk", rounds_ef=True, ddp_ef=True),
        *TOPK,
        "train.ddp_wire_dtype=int4",
        "train.ddp_warm_start=75",
    ],
    "topk-ef-nowarm": [*_wire("topk", rounds_ef=True, ddp_ef=True), *TOPK, "train.ddp_warm_start=0"],
    "topk4-ef-updateswarm": [
        *_wire("topk", rounds_ef=True, ddp_ef=True),
        *TOPK,
        "diloco.codec_value_bits=4",
        "train.warm_start_sync=updates",
    ],
    # the rounds 1-bit, the warm start's gradients 2-bit (int2 drops 12% of a Gaussian block, sign 36%)
    "sign-ef-int2warm": [*_wire("sign", rounds_ef=True, ddp_ef=True), "train.ddp_wire_dtype=int2"],
    # the warm start averages each worker's AdamW update in int2 (their magnitudes alike: 1.5 RMS fits them)
    "sign-ef-int2updateswarm": [
        *_wire("sign", rounds_ef=True, ddp_ef=True),
        "train.ddp_wire_dtype=int2",
        "train.warm_start_sync=updates",
    ],
    "topk8-ef-int4warm": [
        *_wire("topk", rounds_ef=True, ddp_ef=True),
        "diloco.codec_block=4096",
        "diloco.codec_density=0.125",  # 1/8: at 1/64 each value is sent ~1.5 times in the protocol's 100 rounds
        "train.ddp_wire_dtype=int4",
    ],
    "int2-ef-int2warm": _wire("int2", rounds_ef=True, ddp_ef=True),
    "int2-ef-int4warm": [*_wire("int2", rounds_ef=True, ddp_ef=True), "train.ddp_wire_dtype=int4"],
    "int2-ef-updateswarm": [*_wire("int2", rounds_ef=True, ddp_ef=True), "train.warm_start_sync=updates"],
    "int2-noef-updateswarm": [*_wire("int2", rounds_ef=False, ddp_ef=False), "train.warm_start_sync=updates"],
    # without error feedback on the rounds (the warm start as in the row with it): what error feedback is worth
    "int2-noef-int2warm": _wire("int2", rounds_ef=False, ddp_ef=True),
    "topk8-noef-int4warm": [
        *_wire("topk", rounds_ef=False, ddp_ef=True),
        "diloco.codec_block=4096",
        "diloco.codec_density=0.125",
        "train.ddp_wire_dtype=int4",
    ],
}
# every row again with torch's Muon as the inner optimizer for the blocks' matrices (issue 31; its default
# muon_lr 0.02): the row's name + "muon", e.g. fp32muon, int4-efmuon, sign-ef-int2updateswarmmuon
CODECS |= {f"{name}muon": [*overrides, "train.inner_optimizer=muon"] for name, overrides in list(CODECS.items())}


def _outcome(*, name: str, mode: str, workers: int, seed: int, args: argparse.Namespace, extra: list[str]) -> Outcome:
    """Read from the baseline folder when it holds this run (fp32 and DDP rows), else train it in --out."""
    common = protocol(steps=args.steps, inner_steps=args.inner_steps, seq_len=args.seq_len, batch=args.batch_size)
    if mode == "diloco":
        common.append(f"train.ddp_warm_start={args.warm_start}")
    base = Path(args.baseline)
    baseline_name = {"fp32": "diloco-4", "ddp-4": "ddp-4"}.get(name)
    if baseline_name and (base / f"{baseline_name}-s{seed}" / "metrics.jsonl").is_file():
        o = run_one(name=baseline_name, mode=mode, workers=workers, seed=seed, out=base, overrides=common)
        return Outcome(**{**o.__dict__, "name": name})
    run = name if mode == "ddp" else f"diloco-4-{name}"
    return run_one(name=run, mode=mode, workers=workers, seed=seed, out=Path(args.out), overrides=common + extra)


def _rounds_bytes(outcome: Outcome, *, args: argparse.Namespace) -> int:
    """Bytes the run's outer rounds sent (its round records'), the warm start's left out."""
    folder = Path(args.baseline) / f"diloco-4-s{outcome.seed}"  # read from there: its name was set to fp32
    if outcome.name != "fp32" or not (folder / "metrics.jsonl").is_file():
        folder = Path(args.out) / f"{outcome.name}-s{outcome.seed}"  # trained here: the run's own name
    return sum(r["bytes_sent"] for r in read_metrics(folder) if r.get("type") == "round")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/codecs", help="folder for the codec runs and table.md / results.json")
    p.add_argument("--baseline", default="runs/convergence", help="the convergence benchmark's folder")
    p.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated subset of {list(CODECS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument(
        "--reference",
        default="fp32",
        help="the row the 'vs' columns compare with, seed by seed too (fp32: fp32 DiLoCo; fp32muon: with Muon)",
    )
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warm-start", type=int, default=100)
    p.add_argument(
        "--ddp-mb",
        type=float,
        default=None,
        help="DDP x4's MB sent per worker, read from the convergence table instead of running ddp-4 here "
        "(its traffic does not depend on the seed: 4042.1 in docs/results.md)",
    )
    args = p.parse_args(argv)
    names = args.codecs.split(",")
    unknown = sorted(set(names) - set(CODECS)) + ([] if args.reference in names else [f"--reference {args.reference}"])
    if unknown:
        p.error(f"unknown codec row(s) {unknown}; valid: {list(CODECS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = names if args.ddp_mb else ["ddp-4", *names]
    outcomes: dict[str, list[Outcome]] = {n: [] for n in rows}
    for seed in seeds:  # seed-major: every row has a first seed early
        for name in rows:
            mode, workers = ("ddp", 4) if name == "ddp-4" else ("diloco", 4)
            extra = CODECS.get(name, [])
            outcomes[name].append(_outcome(name=name, mode=mode, workers=workers, seed=seed, args=args, extra=extra))
    ddp = args.ddp_mb * 1e6 if args.ddp_mb else statistics.fmean(o.bytes_sent for o in outcomes["ddp-4"])
    ref = args.reference
    fp32 = statistics.fmean(o.eval_loss for o in outcomes[ref]) if ref in outcomes else float("nan")
    by_seed = {o.seed: o.eval_loss for o in outcomes.get(ref, [])}
    lines = [
        f"| wire | error feedback | seeds | eval loss (mean) | spread | vs {ref} | per seed | MB sent / worker"
        + " | traffic vs DDP | rounds alone: MB, vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    results = {}
    for name in names:
        mine = outcomes[name]
        loss = statistics.fmean(o.eval_loss for o in mine)
        spread = max(o.eval_loss for o in mine) - min(o.eval_loss for o in mine)
        sent = statistics.fmean(o.bytes_sent for o in mine)
        rounds = statistics.fmean(_rounds_bytes(o, args=args) for o in mine)
        muon = name.endswith("muon") and name != "muon"
        wire, _, rest = name.removesuffix("muon").partition("-")
        ef, _, warm = rest.partition("-")
        wire += f" ({warm.removesuffix('warm')} warm start)" if warm else ""
        wire += ", Muon" if muon else ""
        results[name] = {
            "eval_loss": loss,
            "spread": spread,
            "bytes": sent,
            "rounds_bytes": rounds,
            "vs_fp32": loss / fp32 - 1,
            "seeds": len(mine),
        }
        paired = ", ".join(f"{100 * (o.eval_loss / by_seed[o.seed] - 1):+.2f}" for o in mine if o.seed in by_seed)
        lines.append(
            f"| {wire} | {'-' if not ef else ef == 'ef'} | {len(mine)} | {loss:.4f} | {spread:.4f} "
            f"| {100 * (loss / fp32 - 1):+.2f}% | {paired} | {sent / 1e6:.1f} | 1/{ddp / sent:.1f} "
            f"| {rounds / 1e6:.2f}, 1/{ddp / max(rounds, 1):.0f} |"
        )
    text = "\n".join(lines) + "\n"
    within = [n for n in names if n != ref and results[n]["vs_fp32"] <= 0.01]
    if within:
        best = min(within, key=lambda n: results[n]["bytes"])
        text += (
            f"\nLargest traffic reduction within 1% of {ref}: {best} ({100 * results[best]['vs_fp32']:+.2f}%), "
            f"{ddp / results[best]['bytes']:.1f}x less than DDP ({ddp / 1e6:.1f} MB per worker).\n"
        )
    print(text)
    Path(args.out, "table.md").write_text(text)
    Path(args.out, "results.json").write_text(
        json.dumps({"args": vars(args), "ddp_bytes": ddp, "rows": results}, indent=1)
    )
    print(f"total {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

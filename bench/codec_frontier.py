"""The compression frontier: each codec row's traffic reduction against DDP (log axis) and its eval loss against
fp32 DiLoCo, from one or more ``bench/codec_ablation.py`` results (its ``--out`` folder's results.json, copied
aside where one folder's rows were run with different seeds).

Each row is drawn twice: its total traffic (warm start and rounds, filled) and its rounds alone (hollow), joined
by a line; the bar is half the row's loss spread over its seeds (in % of its loss). The dashed lines mark the
issue's goals: within +1% of fp32 at >= 100x (and the 500x moonshot).

    python bench/codec_frontier.py runs/codecs/results.json --out docs/codec-frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(files: list[str]) -> dict[str, dict]:
    """Every row but the reference (fp32, or the file's ``--reference``) of the results files, a later file's row
    over an earlier's."""
    rows: dict[str, dict] = {}
    for file in files:
        data = json.loads(Path(file).read_text())
        for name, row in data["rows"].items():
            if name != data["args"].get("reference", "fp32"):
                rows[name] = {**row, "ddp_bytes": data["ddp_bytes"]}
    return rows


def plot(rows: dict[str, dict], out: Path, *, reference: str = "fp32 DiLoCo") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    for i, (name, row) in enumerate(sorted(rows.items(), key=lambda r: r[1]["bytes"])):
        color = f"C{i % 10}"
        total, rounds = row["ddp_bytes"] / row["bytes"], row["ddp_bytes"] / max(row["rounds_bytes"], 1)
        y, err = 100 * row["vs_fp32"], 100 * row["spread"] / 2 / row["eval_loss"]  # half the spread, in %
        label = f"{name} ({row['seeds']} seed{'s' if row['seeds'] > 1 else ''})"
        ax.errorbar([total], [y], yerr=[err], fmt="o", color=color, label=label, capsize=3)
        ax.plot([rounds], [y], "o", mfc="none", color=color)
        ax.plot([total, rounds], [y, y], ":", color=color, lw=0.8)
    ax.axhline(1.0, ls="--", color="grey", lw=0.8)
    for goal in (100, 500):
        ax.axvline(goal, ls="--", color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("traffic reduction vs DDP (x, log): filled = total with the warm start, hollow = rounds alone")
    ax.set_ylabel(f"final eval loss vs {reference} (%)")
    ax.set_title("Codecs on the convergence protocol (DiLoCo x4, H = 10, 1100 steps)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no point hidden
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="codec_ablation.py's results.json files")
    p.add_argument("--out", default="codec-frontier.png")
    p.add_argument("--reference", default="fp32 DiLoCo", help="what the rows were compared with, for the y label")
    args = p.parse_args(argv)
    plot(rows_of(args.results), Path(args.out), reference=args.reference)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

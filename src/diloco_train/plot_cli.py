"""``diloco plot``: several runs' loss curves in one PNG, against step, bytes sent or training time (``plot``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .plot import X_CHOICES

__all__ = ["configure_plot_parser", "plot_main"]


def configure_plot_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (e.g. runs/diloco-...)")
    p.add_argument(
        "--out",
        metavar="FILE.png",
        help="output file (default: plot.png in the only run, else runs.png next to the first)",
    )
    p.add_argument(
        "--x",
        choices=X_CHOICES,
        default="step",
        help="x axis: step, bytes (MB rank 0 sent), time (training seconds, evals left out), or all three",
    )


def plot_main(args: argparse.Namespace) -> int:
    from .plot import plot_runs

    first = Path(args.runs[0])
    out = args.out or (first / "plot.png" if len(args.runs) == 1 else first.parent / "runs.png")
    print(plot_runs(args.runs, out, x=args.x))
    return 0

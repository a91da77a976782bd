"""``diloco plot``: several runs' loss curves in one PNG, against step, bytes sent or training time (``plot``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..report.plot import X_CHOICES
from ..runs.run_folder import RunFolder

__all__ = ["configure_plot_parser", "plot_main"]


def configure_plot_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (e.g. runs/diloco-...)")
    p.add_argument(
        "--out",
        metavar="FILE.png",
        help="output file (default: plot.png in the only run, else runs.png next to the first; "
        "another --x than step adds it: plot-all.png, never the run's own plot.png)",
    )
    p.add_argument(
        "--x",
        choices=X_CHOICES,
        default="step",
        help="x axis: step, bytes (MB rank 0 sent), time (training seconds, evals left out), or all three",
    )


def default_out(runs: list[str], *, x: str) -> Path:
    """Where a plot goes without ``--out``: the run's own plot.png is the trainer's (step axis), so
    another axis gets a name of its own (``plot-all.png``), as does a plot of several runs."""
    first = Path(runs[0])
    if len(runs) == 1:
        return RunFolder(first).plot(x)
    return first.parent / ("runs.png" if x == "step" else f"runs-{x}.png")


def plot_main(args: argparse.Namespace) -> int:
    from ..report.plot import plot_runs

    out = args.out or default_out(args.runs, x=args.x)
    print(plot_runs(args.runs, out, x=args.x))
    return 0

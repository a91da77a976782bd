"""``diloco torchrun``: torchrun's launcher, ending in one line instead of torchrun's own tracebacks.

torchrun (``torch.distributed.run``) answers Ctrl+C with two chained ``SignalException`` tracebacks and a
failed worker with a ``ChildFailedError`` report of ~30 lines, after the worker already said what went
wrong. This runs the same launcher in-process, with the same options, and turns both endings into one
line: the workers speak for themselves (rank 0 prints the resume hint; a worker's ``diloco: error:``
line names the problem), and the launcher only says which rank failed and how.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Sequence

__all__ = ["TORCHRUN_ARGS_ENV", "split_launcher_args", "torchrun"]

TORCHRUN_ARGS_ENV = "DILOCO_TORCHRUN_ARGS"
"""Set for the workers: the launcher's options, so that their resume hints repeat them."""

_USAGE = "usage: diloco torchrun [TORCHRUN OPTIONS] train [TRAIN OPTIONS]  (e.g. --standalone --nproc-per-node=2)"


def split_launcher_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[torchrun options] train [train options]`` -> (torchrun's options, the ``train`` command line)."""
    argv = list(argv)
    if "train" not in argv:
        raise ValueError(
            f"diloco torchrun needs the train command after torchrun's options; {_USAGE}"
        )
    at = argv.index("train")
    launcher = argv[:at]
    script = [a for a in launcher if not a.startswith("-")]
    if script and script[-1].endswith((".py", "diloco_train.cli")):
        raise ValueError(
            f"diloco torchrun starts diloco_train.cli itself; drop {script[-1]!r}; {_USAGE}"
        )
    return launcher, argv[at:]


def torchrun(argv: Sequence[str]) -> int:
    """Launch ``diloco train`` under torchrun's elastic agent; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    launcher, train = split_launcher_args(argv)
    args = parse_args([*launcher, "-m", "diloco_train.cli", *train])
    os.environ[TORCHRUN_ARGS_ENV] = shlex.join(launcher)  # the workers inherit it
    # The agent logs what the workers already said ("Received 2 death signal", "failed (exitcode: 2)").
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(("torch.distributed.run", "torch.distributed.elastic")) and isinstance(
            logger, logging.Logger
        ):
            logger.setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as e:
        # Ctrl+C (or a SIGTERM) reached the agent; it has stopped the workers, and rank 0 printed the hint.
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = (
            f"exit status {failure.exitcode}"
            if failure.exitcode >= 0
            else f"signal {-failure.exitcode}"
        )
        print(
            f"diloco: error: worker rank {rank} ended with {how} (its own message is above)",
            file=sys.stderr,
        )
        return failure.exitcode if 0 < failure.exitcode < 128 else 1
    return 0

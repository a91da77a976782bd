"""``diloco train``, ``diloco plot``, ``diloco export`` and ``diloco torchrun``. Bad input ends with one clear line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import logging
import multiprocessing.util
import os
import shlex
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from diloco_core import TransportError

from ..interrupts import INTERRUPTS
from ..report.log_tag import configure_logging
from ..runs.run_folder import RunFolder
from .doctor_cli import DOCTOR_EXAMPLE, doctor_main
from .export_cli import EXPORT_EXAMPLE, configure_export_parser, export_main
from .plan_cli import PLAN_EXAMPLE, configure_plan_parser, plan_main
from .plot_cli import configure_plot_parser, plot_main
from .torchrun import TORCHRUN_ARGS_ENV
from .train_cli import TRAIN_EXAMPLE, config_keys, configure_train_parser

if TYPE_CHECKING:
    from ..run_config import RunConfig

__all__ = ["main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diloco")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diloco", description="Train a language model with DiLoCo (or DDP, or one worker)."
    )
    p.add_argument("--version", action="version", version=f"diloco {_version()}")
    sub = p.add_subparsers(dest="command", metavar="{train,plot,plan,export,torchrun,doctor}")
    configure_train_parser(
        sub.add_parser(
            "train",
            help="train (with no options: tiny model, 4 in-process workers, a few minutes on a CPU)",
            epilog=f"{TRAIN_EXAMPLE}\n\n{config_keys()}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    sub.add_parser(
        "torchrun",
        help="torchrun's launcher for `train` (same options), ending in one line on Ctrl+C or a failed worker",
        usage="diloco torchrun [TORCHRUN OPTIONS] train [TRAIN OPTIONS]",
        epilog="e.g. diloco torchrun --standalone --nproc-per-node=2 train --set transport.kind=torch (docs/lan.md)",
    )
    configure_plot_parser(
        sub.add_parser(
            "plot", help="overlay the loss curves of runs (x: step, bytes, time) in a PNG"
        )
    )
    configure_plan_parser(
        sub.add_parser(
            "plan",
            help="predict compute utilization and time per 1,000 steps for H and each overlap mode on a link",
            epilog=PLAN_EXAMPLE,
        )
    )
    configure_export_parser(
        sub.add_parser(
            "export",
            help="write a run's global model as safetensors and a Hugging Face folder",
            epilog=EXPORT_EXAMPLE,
        )
    )
    configure_train_parser(  # the same options: a join command with doctor for train
        sub.add_parser(
            "doctor",
            help="check a run's network before it starts (addresses, secret, reachability, clocks)",
            epilog=DOCTOR_EXAMPLE,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    return p


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The run's config: defaults, ``--config`` files and ``--set``; after ``--resume`` those merged onto the
    saved config (its changes said). Deprecation warnings are shown (Python hides a library's)."""
    from ..run_config import build_config, load_toml
    from ..runs.resume_merge import merge_onto_saved

    saved = _saved_config(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        # else nothing to resume yet: start the run as configured
        if saved is not None and saved.is_file():
            config, changes = merge_onto_saved(
                load_toml(saved),
                files=args.config,
                overrides=args.overrides,
                force=args.force,
            )
            if os.environ.get("RANK", "0") == "0":
                for line in changes:
                    print(f"diloco: resume changes {line}", file=sys.stderr)
        else:
            config = build_config(args.config, args.overrides)
    for w in caught:
        print(f"diloco: {w.message}", file=sys.stderr)
    return config


def _saved_config(args: argparse.Namespace) -> Path | None:
    """Where the config of the run ``--resume`` continues is saved (None: not a resume)."""
    from ..run_config import build_config, parse_override
    from ..runs.run_name import check_name

    if args.name is not None:
        check_name(args.name)
    if not args.resume:
        if args.force:
            raise ValueError("--force is for --resume: it accepts changes to the saved config")
        return None
    if not args.name:
        raise ValueError("--resume needs --name RUN: the run to continue")
    # The overrides apply to the saved config (e.g. a transport's secret, never saved), so they are
    # not checked against the defaults first: only train.runs_dir is needed to find the run.
    where = [o for o in args.overrides if parse_override(o)[:2] == ("train", "runs_dir")]
    return RunFolder(Path(build_config((), where).train.runs_dir) / args.name).config


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from transports import transport_spec

    from ..launch import train
    from ..layout import check_quorum
    from ..report.run_words import run_header, run_summary, traffic_line
    from ..runs.run_name import default_name, resume_command

    config = _run_config(args)
    spec = transport_spec(config.transport)
    check_quorum(config, spec)  # a config error, before the run's first line
    name = args.name or default_name(config.train.mode)  # torchrun's ranks take rank 0's (launch)
    run_dir = Path(config.train.runs_dir) / name
    t = config.train
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print(run_header(config, run_dir, fixed_ranks=spec.fixed_ranks), file=sys.stderr)
    command = ["diloco", "train", *argv]
    # Under ``diloco torchrun`` the hint repeats its launcher options (the wrapper passes them down).
    torchrun_args = os.environ.get(TORCHRUN_ARGS_ENV)
    launcher = (
        ["diloco", "torchrun", *shlex.split(torchrun_args)]
        if torchrun_args is not None
        else ["diloco"]
    )

    def again() -> str:  # once the run has started: a secret it stored is read back by the resume
        return resume_command(
            name, config, launcher=launcher, secret_stored=RunFolder(run_dir).join_secret.is_file()
        )

    try:
        result = train(
            config,
            run_dir,
            resume=args.resume,
            show_progress=not args.quiet,
            command=command,
            named=bool(args.name),
        )
    except KeyboardInterrupt:
        INTERRUPTS.ignore()  # a second Ctrl+C (or torchrun's SIGTERM) adds nothing
        if os.environ.get("RANK", "0") == "0":
            print(_interrupted(run_dir, again()), file=sys.stderr)
        _exit_now(INTERRUPTS.status)
    if not result.rank0:  # a process of a multi-process run without rank 0, which reports
        return 0
    print(run_summary(result, run_dir))
    if result.steps < t.steps:
        print(
            f"stopped at step {result.steps} of {t.steps} (train.stop_after); resume with: {again()}"
        )
    traffic = traffic_line(result, config)
    if traffic is not None:
        print(traffic)
    return 0


def _interrupted(run_dir: Path, again: str) -> str:
    """The last line of an interrupted run: the step it can resume from and how, or that nothing can be."""

    steps = RunFolder(run_dir).rank(0).steps()
    if not steps:
        return f"diloco: interrupted ({INTERRUPTS.name}) before the first checkpoint: nothing can be resumed"
    return f"diloco: interrupted ({INTERRUPTS.name}); newest checkpoint: step {steps[-1]} (resume with: {again})"


def _exit_now(status: int) -> NoReturn:
    """End the process after a Ctrl+C without the interpreter's teardown. By now the run's files are
    closed and its transports left (the launcher's ``finally`` blocks); what the teardown would add is
    torch's C++ static destructors, which aborted 4 of 6 interrupted runs here ("terminate called
    without an active exception", exit 134 instead of 130). multiprocessing's temporary folder
    (pymp-*, which its skipped finalizer would remove) is removed here."""
    shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``diloco`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["train"]  # the embedded default run
    if argv[0] == "torchrun" and not {"-h", "--help"} & set(argv[1:2]):
        # torchrun's options are torchrun's to parse (argparse would take them for ours).
        from .torchrun import torchrun

        try:
            return torchrun(argv[1:])
        except ValueError as e:
            print(f"diloco: error: {e}", file=sys.stderr)
            return 2
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help(sys.stderr)
        return 2
    level = logging.INFO if getattr(args, "verbose", False) else logging.WARNING
    configure_logging(level)
    try:
        if args.command == "train":
            with INTERRUPTS.installed():
                return _train(args, argv[1:])
        if args.command == "plan":
            return plan_main(args)
        if args.command == "export":
            return export_main(args)
        if args.command == "doctor":
            return doctor_main(args)
        return plot_main(args)
    except (ValueError, TransportError, OSError) as e:
        # One write, line and newline together: stderr writes through, and print's two writes from two ranks of a
        # torchrun job interleaved into one line of both messages and an empty one.
        sys.stderr.write(f"diloco: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        print(
            f"diloco: interrupted ({INTERRUPTS.name}) before training started: nothing can be resumed",
            file=sys.stderr,
        )
        return INTERRUPTS.status


if __name__ == "__main__":
    sys.exit(main())

"""Starting a run: this process's workers as the transport's spec lays them out, threads or just one.

The transport factory says how a [transport] section launches (``transports.transport_spec``): all the
run's workers as threads of this process, or this process as one worker of many (torchrun, a hivemind
peer). The trainer never names a transport kind.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch

from diloco_core import Transport
from transports import TransportSpec, transport_spec

from .data.corpus import Corpus, load_corpus
from .data.shards import check_data, check_shards
from .interrupts import INTERRUPTS
from .job import Job
from .layout import check_processes, local_workers
from .report.metrics import TrainResult
from .report.sinks import check_sinks
from .run_config import RunConfig
from .run_workers import run_workers
from .runs.join import check_ports, print_join, stored_secret
from .runs.ownership import RunOwner, remove_unused
from .runs.resume import check_resume_workers, prepare_run_dir
from .runs.run_folder import RunFolder
from .runs.run_name import agree_run_dir

__all__ = ["train"]

logger = logging.getLogger(__name__)


def train(
    config: RunConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    command: list[str] | None = None,
    named: bool = True,
    wrap: Callable[[Transport], Transport] | None = None,
    create: Callable[..., Transport] | None = None,
) -> TrainResult:
    """Train as ``config`` says, writing into ``run_dir``. ``command``: argv shown to peers that join by address.
    ``named=False``: ``run_dir``'s name was made up here (not given), and ranks of a multi-process run take
    rank 0's. ``wrap``: each worker's transport goes through it (a ``ForwardingTransport``: faults, tracing, the
    insiders of bench/insider.py). ``create``: where each process is one worker, it makes this
    process's transport from the ``[transport]`` section (it takes ``create_transport``'s
    arguments) in place of the kind's own constructor: faults a transport takes only as it is
    built (bench/insider.py's relaying hivemind owner).

    Workers run as threads of this process where the transport's spec says so; else this process is one
    worker. Only rank 0 writes files (metrics, config, plot); every rank its own checkpoints; another
    rank's result holds NaN losses. This process owns the ranks it writes for (``RunOwner``) while it runs.
    A start that fails removes the folder it made while nothing of the run is in it
    (``remove_unused``).
    """
    run_dir = Path(run_dir)
    made = not run_dir.exists()
    try:
        return _start(
            config,
            run_dir,
            resume=resume,
            show_progress=show_progress,
            command=command,
            named=named,
            wrap=wrap,
            create=create,
        )
    except BaseException:
        if made:
            remove_unused(run_dir, spare=_nothing_of_a_run)
        raise


def _nothing_of_a_run(path: Path) -> bool:
    """What a start writes before the run has a record: config.toml, an empty metrics.jsonl."""
    return path.name == RunFolder.CONFIG or (
        path.name == RunFolder.METRICS and path.stat().st_size == 0
    )


def _start(
    config: RunConfig,
    run_dir: Path,
    *,
    resume: bool,
    show_progress: bool,
    command: list[str] | None,
    named: bool,
    wrap: Callable[[Transport], Transport] | None,
    create: Callable[..., Transport] | None,
) -> TrainResult:
    if resume:
        config = stored_secret(config, run_dir)
    given = (
        config  # as configured: the join command gives it to the next peer, which resolves it alike
    )
    t = config.train
    spec = transport_spec(config.transport)
    check_processes(config, spec)
    corpus = load_corpus(config.data)
    config = _resolve_model(config, corpus)
    local = local_workers(config, spec)
    # Workers sharing this machine's cores: threads here, times the worker processes on this node (torchrun).
    # Oversubscribed cores make every OpenMP region wait on a busy core (seen: 10x slower steps).
    torch.set_num_threads(
        t.threads or max(1, (os.cpu_count() or 1) // (local * spec.processes_on_machine))
    )
    check_shards(t, spec)
    if t.fsdp_shards > 1 and not spec.fsdp_islands:
        raise ValueError(
            f"train.fsdp_shards={t.fsdp_shards} shards each island's model over torch.distributed ranks: it "
            f"needs [transport] kind='torch' under torchrun, not kind={spec.kind!r}"
        )
    with ExitStack() as owner, ExitStack() as stack:
        transports = _connect(
            config,
            spec,
            local=local,
            owner=owner,
            stack=stack,
            run_dir=run_dir,
            wrap=wrap,
            create=create,
        )
        first = transports[0]
        world = 1 if first is None else first.world_size
        if first is not None and not spec.threads and spec.fixed_ranks:
            if not named and world > 1:
                run_dir = agree_run_dir(first, run_dir, timeout=config.diloco.reduce_timeout)
            owner.callback(RunOwner(run_dir, [first.rank]).release)
        lead = first is None or first.rank == 0  # rank 0 is in this process
        job = _job(config, spec, corpus=corpus, run_dir=run_dir, resume=resume, world=world)
        stack.callback(job.outcome.close)
        # this process runs all the run's workers: a signal stops them at a step they checkpoint
        if spec.threads:
            stack.callback(INTERRUPTS.stop_softly(job.stops.softly))
        check_data(config, corpus, world)
        if lead:
            _prepare(job, spec, first=first, given=given, command=command)
        run_workers(job, transports=transports, show=show_progress, lead=lead)
        if job.stops.interrupted:
            raise KeyboardInterrupt
        stack.close()  # the transports are left and metrics.jsonl closed; the folder is still this process's
        if lead:
            _plot(run_dir)
    if not lead:
        return _not_rank_0(run_dir, steps=t.steps)
    result = job.outcome.result
    assert result is not None
    return result


def _connect(
    config: RunConfig,
    spec: TransportSpec,
    *,
    local: int,
    owner: ExitStack,
    stack: ExitStack,
    run_dir: Path,
    wrap: Callable[[Transport], Transport] | None,
    create: Callable[..., Transport] | None,
) -> Sequence[Transport | None]:
    """This process's workers' transports (None: a single run's), each closed by ``stack``. The run folder is
    claimed by ``owner`` first where this process's ranks are known before connecting."""
    # Threads: all the ranks are here; a peer without fixed ranks writes as rank 0; else (torchrun) the rank is
    # known once the transport has said it (the caller claims it then).
    if spec.threads or not spec.fixed_ranks:
        owner.callback(RunOwner(run_dir, range(local) if spec.threads else [0]).release)
    if not spec.threads:
        # a port taken by a peer here: said so, before the transport starts
        check_ports(spec.section)
    # [diloco] reduce_timeout also bounds the transport's own collectives unless [transport] sets them.
    timeout = config.diloco.reduce_timeout
    transports: Sequence[Transport | None] = (
        [None]
        if config.train.mode == "single"
        else spec.connect(local, reduce_timeout=timeout, create=create)
    )
    if wrap is not None:
        transports = [None if x is None else wrap(x) for x in transports]
    for transport in transports:
        if transport is not None:
            stack.callback(transport.close)
    return transports


def _job(
    config: RunConfig,
    spec: TransportSpec,
    *,
    corpus: Corpus,
    run_dir: Path,
    resume: bool,
    world: int,
) -> Job:
    """What this process's workers share, once the world's size is known."""
    shards = config.train.fsdp_shards
    if world % shards:
        raise ValueError(
            f"train.fsdp_shards={shards} is invalid: expected a divisor of the world size {world} "
            "(torchrun's processes), which it splits into islands of that many ranks"
        )
    timeout = config.diloco.reduce_timeout
    return Job(
        config=config,
        corpus=corpus,
        run_dir=run_dir,
        resume=resume,
        same_disk=spec.threads,
        secret_keys=spec.secret_keys,
        islands=functools.partial(spec.connect_islands, reduce_timeout=timeout)
        if shards > 1
        else None,
    )


def _prepare(
    job: Job,
    spec: TransportSpec,
    *,
    first: Transport | None,
    given: RunConfig,
    command: list[str] | None,
) -> None:
    """Rank 0's part before training: the run folder written, a resume's workers checked, the join command."""
    # the extras train.log_to needs, before the run folder is written
    check_sinks(job.config.train.log_to)
    prepare_run_dir(job.run_dir, job.config, resume=job.resume, secret_keys=spec.secret_keys)
    if job.resume and spec.threads:  # every worker's checkpoint is on this disk
        check_resume_workers(job.run_dir, first.world_size if first is not None else 1)
    if first is not None:
        print_join(first, spec=spec, config=given, command=command, run_dir=job.run_dir)


def _not_rank_0(run_dir: Path, *, steps: int) -> TrainResult:
    """The result of a process without rank 0, which reports the run: NaN losses."""
    return TrainResult(
        run_dir=run_dir,
        steps=steps,
        eval_before=math.nan,
        eval_after=math.nan,
        wall_seconds=0.0,
        compute_seconds=0.0,
        bytes_sent=0,
        rank0=False,
    )


def _resolve_model(config: RunConfig, corpus: Corpus) -> RunConfig:
    if config.model.vocab_size is not None and config.model.vocab_size < corpus.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's {corpus.vocab_size}"
        )
    return replace(config, model=config.model.resolved(vocab_size=corpus.vocab_size))


def _plot(run_dir: Path) -> None:
    try:
        from .report.plot import plot_runs

        plot_runs([run_dir], RunFolder(run_dir).plot())
    except ImportError as e:  # matplotlib is an optional extra
        logger.warning("no plot written (%s): pip install 'diloco[train]'", e)

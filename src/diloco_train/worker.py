"""One worker's training loop: its model, optimizer and data shard, its mode's sync, checkpoints and (rank 0)
metrics. Only rank 0 writes metrics and shows the progress bar; every rank writes its own checkpoint.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco_core import Transport

from .checkpoint import remove_stray_temp
from .compute import autocast, device_for, evaluate, loss_of
from .config import MAX_SEED, RunConfig
from .data import BatchSampler, Corpus
from .divergence import LossWatch, all_finite, newest_checkpoint
from .evals import EvalSchedule, global_weights
from .fsdp import evaluates, shard_model
from .inner_optimizer import build_inner_optimizer
from .interrupts import INTERRUPTS
from .log_tag import set_worker
from .metrics import Reporter, TrainResult
from .model import Llama
from .modes import Sync
from .pace import Pace, speed_of
from .resume import checkpoint_due, commit_resume, confirm_loaded, load_worker, save_worker
from .resume_from import resume_step, set_aside
from .schedule import lr_at, set_lr
from .shards import shard_of
from .sinks import open_sinks

__all__ = ["Job", "Worker"]

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One invocation, as its workers (threads of this process, or just one) share it."""

    config: RunConfig
    corpus: Corpus
    run_dir: Path
    resume: bool
    same_disk: bool = False
    """Every worker's checkpoints are in this process's run folder (in-process workers): saved once there."""
    secret_keys: frozenset[str] = frozenset()
    """Keys of [transport] never written to config.toml."""
    islands: Callable[[torch.nn.Module, Any], Transport] | None = None
    """train.fsdp_shards > 1: the transport between the islands for a model sharded over a mesh
    (``TransportSpec.connect_islands``); DiLoCo averages over it, the trainer's own agreements over the world."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when a worker thread fails or the run is interrupted: the others leave their loop."""
    errors: list[BaseException] = field(default_factory=list)
    """What the worker threads raised, for the launching thread to re-raise."""
    reporter: Reporter | None = None
    """Rank 0's, once it has started (the launcher closes it)."""
    busy: dict[int, float] = field(default_factory=dict)
    """Each worker's busy seconds so far (``Pace``), for rank 0's goodput when every worker is in this process."""
    result: TrainResult | None = None
    """Rank 0's, once it has finished."""
    warned_nonfinite: bool = False
    """A worker has said that a state of its was not finite, so not checkpointed (said once per process)."""
    interrupted: bool = False
    """A signal asked the run to stop: its workers stop at one step (``stop_at``), checkpoint it and leave."""
    stop_at: int | None = None
    begun: dict[int, int] = field(default_factory=dict)
    """Each worker's step once it has begun it (the one it will reach), for ``stop_at``."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request_stop(self) -> bool:
        """From the signal handler: every worker of this process stops at the same step (``stop_here``) and
        checkpoints it. False where no worker has begun a step: nothing new to checkpoint, stop at once."""
        with self.lock:
            self.interrupted = bool(self.begun)
            return self.interrupted

    def stop_here(self, rank: int, step: int) -> bool:
        """Whether ``rank``, about to begin the step after ``step``, stops instead. Once interrupted, the workers
        stop at the furthest step one of them has begun (they may be a round apart), so each stops at that one
        step and checkpoints it; none begins a step past it."""
        with self.lock:
            if self.interrupted and self.stop_at is None:
                self.stop_at = max(self.begun.values(), default=step)
            if self.stop_at is not None and step >= self.stop_at:
                return True
            self.begun[rank] = step + 1
            return False

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()


class Worker:
    def __init__(self, job: Job, *, rank: int, world_size: int, transport: Transport | None, show: bool) -> None:
        self.job, self.rank, self.world_size, self.transport, self.show = job, rank, world_size, transport, show
        self.config, self.t = job.config, job.config.train
        self.device = device_for(self.t, rank)

    def run(self) -> None:
        job, c, t = self.job, self.config, self.t
        model = Llama(c.model, generator=torch.Generator().manual_seed(t.seed)).to(self.device)
        between = self.transport  # what DiLoCo averages over: the world, or the islands (FSDP2)
        if job.islands is not None:
            between = job.islands(model, shard_model(model, t.fsdp_shards, self.device))
        optimizer = build_inner_optimizer(model, t)
        shard, num_shards = shard_of(t, rank=self.rank, world_size=self.world_size)
        fixed = self.transport is None or self.transport.capabilities.fixed_ranks
        set_worker(f"worker {self.rank}" if fixed else f"peer shard {shard}")
        remove_stray_temp(job.run_dir / "checkpoints", self.rank)  # of a write this rank's last process left
        sampler = BatchSampler(
            job.corpus.shard(shard, num_shards),
            seq_len=c.data.seq_len,
            batch_size=t.batch_size,
            seed=(t.seed * 1_000_003 + shard + 1) % (MAX_SEED + 1),  # unchanged where it fits 64 bits
            what=f"shard {shard} of {num_shards} of the training data",
        )
        sync = Sync(config=c, model=model, optimizer=optimizer, transport=between, device=self.device)
        pace = Pace(speed_of(t.speeds, shard))
        step = self._resume(sync, sampler) if job.resume else 0

        end = min(t.stop_after, t.steps) if t.stop_after else t.steps
        h = c.diloco.inner_steps
        schedule = EvalSchedule(every=t.eval_every or h, start=step, end=end)
        reporter: Reporter | None = None
        evaluating = evaluates(self.rank, t.fsdp_shards)
        if self.rank == 0:
            reporter = Reporter(
                run_dir=job.run_dir,
                world_size=self.world_size,
                start_step=step,
                end_step=end,
                show=self.show,
                sinks=open_sinks(t.log_to, run_dir=job.run_dir, start_step=step),
            )
            job.reporter = reporter
        if evaluating and step == 0:
            loss = self._evaluate(sync)
            if reporter is not None:
                reporter.eval(0, loss, seconds=0.0)  # before the training loop's clock starts
        tokens = t.batch_size * c.data.seq_len
        if reporter is not None:
            reporter.start_clock()
        last_eval = math.nan
        watch = LossWatch(limit=t.max_nonfinite_losses, folder=job.run_dir / "checkpoints", rank=self.rank, lr=t.lr)
        model.train()
        saved = step  # the step of this worker's newest checkpoint here (the resumed one, or none: 0)
        while step < end and not job.stop.is_set() and not job.stop_here(self.rank, step):
            sync.before(step)
            round_before = sync.round
            t0 = time.perf_counter()
            lr = lr_at(sync.position(step), t)
            set_lr(optimizer, lr)
            x, y = sampler.next()
            with autocast(self.device, t.bf16):
                loss = loss_of(model, x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            loss.backward()
            pace.slow_down(time.perf_counter() - t0)
            comm, report = sync.step(t.grad_clip)
            after = sync.advanced(step)  # rounds by time: the run's progress, which moves only as rounds end
            moved, step = after != step, after
            loss_value = loss.item()  # the one host sync per step
            elapsed = time.perf_counter() - t0
            pace.count(elapsed - comm.seconds)
            job.busy[self.rank] = pace.busy
            if reporter is not None:
                if report is not None:
                    reporter.round(step, report)
                reporter.step(
                    {
                        "type": "step",
                        "step": step,
                        "round": sync.round,
                        "loss": loss_value,
                        "lr": lr,
                        "tokens_per_s": tokens * self.world_size / elapsed,
                        "compute_s": elapsed - comm.seconds,
                        "comm_s": comm.seconds,
                        "bytes_sent": comm.bytes_sent,
                        "bytes_received": comm.bytes_received,
                        "time_s": reporter.clock(),
                    }
                )
            if not moved:
                watch.see(step, loss_value)
                continue
            if step == t.steps:  # the end of training (not a stop_after): apply the rounds still in flight
                sync.flush()  # after the step's record: waiting for the last reduce is not compute
            boundary = sync.diloco is None or sync.round != round_before  # the global weights changed
            if schedule.due(step, boundary=boundary) and evaluating:
                began = time.perf_counter()
                last_eval = self._evaluate(sync)
                if reporter is not None:
                    reporter.eval(step, last_eval, seconds=time.perf_counter() - began)
            watch.see(step, loss_value)
            if checkpoint_due(step, end=end, inner_steps=h, every=t.checkpoint_every):
                self._save(step, sync, sampler)
                saved = step
        if job.interrupted and not job.stop.is_set() and step > saved:  # the step all workers stopped at
            self._save(step, sync, sampler)
        if job.stop.is_set() or job.interrupted or not evaluating:
            return
        if math.isnan(last_eval):  # resumed at the very end: nothing trained, still report where it stands
            last_eval = self._evaluate(sync)
        if reporter is not None:
            job.result = reporter.finish(step=step, eval_after=last_eval, busy=list(job.busy.values()))

    def _evaluate(self, sync: Sync) -> float:
        """The validation loss of the run's global weights (``evals``)."""
        with global_weights(sync):
            return evaluate(sync.model, val=self.job.corpus.val, config=self.config, device=self.device)

    def _resume(self, sync: Sync, sampler: BatchSampler) -> int:
        """Load this worker's checkpoint of the step all ranks resume from; that step (0: none yet). Rank 0
        changes the run folder only once every rank has loaded its checkpoint."""
        job, timeout = self.job, self.config.diloco.reduce_timeout
        found = resume_step(job.run_dir, rank=self.rank, transport=self.transport, timeout=timeout)
        step = found.step
        sync.resumed_at(step)
        if found.state is not None:
            fixed = (
                self.transport is None or self.transport.capabilities.fixed_ranks
            )  # else group sizes change every round
            state = load_worker(
                job.run_dir,
                state=found.state,
                step=step,
                world_size=self.world_size,
                config=self.config,
                fixed_ranks=fixed,
            )
            sync.load_state_dict(state["core"])
            sampler.load_state_dict(state["data"])
            logger.info("rank %d: resumed from step %d", self.rank, step)
        confirm_loaded(self.transport, timeout)
        set_aside(job.run_dir, rank=self.rank, resumed=found)  # files after the step resumed from: never kept
        if self.rank == 0:
            commit_resume(job.run_dir, step=step, config=self.config, secret_keys=job.secret_keys)
        return max(step, 0)  # -1: crashed (or restarted by torchrun) before its first checkpoint: start over

    def _save(self, step: int, sync: Sync, sampler: BatchSampler) -> None:
        """Checkpoint ``step``, unless its state holds NaN or inf: then the older checkpoints stay as they are."""
        job, core = self.job, sync.state_dict()
        if not all_finite(core):
            if not job.warned_nonfinite:
                job.warned_nonfinite = True
                newest = newest_checkpoint(job.run_dir / "checkpoints", self.rank)
                logger.warning("step %d: the state holds NaN or infinite values: not checkpointed (%s)", step, newest)
            return
        with INTERRUPTS.deferred():
            save_worker(
                job.run_dir,
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                config=self.config,
                core=core,
                data=sampler.state_dict(),
                same_disk=job.same_disk,
            )

"""One worker's training loop: its model, optimizer and data shard, its mode's sync, checkpoints and (rank 0)
metrics. Only rank 0 writes metrics and shows the progress bar; every rank writes its own checkpoint.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from diloco_core import Transport

from .compute import autocast, device_for, evaluate, loss_of
from .data.corpus import BatchSampler
from .data.shards import shard_of
from .evals import EvalSchedule, global_weights
from .fsdp import evaluates, shard_model
from .inner_optimizer import build_inner_optimizer
from .interrupts import INTERRUPTS
from .job import Job
from .loop import Loop
from .model import Llama
from .modes import Sync
from .pace import Pace, speed_of
from .report.log_tag import set_worker
from .report.metrics import Reporter
from .report.sinks import open_sinks
from .runs.divergence import LossWatch, all_finite
from .runs.resume import checkpoint_due, commit_resume, confirm_loaded, load_worker, save_worker
from .runs.resume_from import resume_step, set_aside
from .runs.run_folder import RunFolder
from .schedule import lr_at, set_lr
from .train_config import MAX_SEED

__all__ = ["Worker"]

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self, job: Job, *, rank: int, world_size: int, transport: Transport | None, show: bool
    ) -> None:
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.show = show
        self.config = job.config
        self.t = job.config.train
        self.device = device_for(self.t, rank)

    def run(self) -> None:
        """Build, resume, train to the end (or a stop), report."""
        loop = self._build()
        job = self.job
        while (
            loop.step < loop.end and not job.stops.now and not job.stops.here(self.rank, loop.step)
        ):
            self._step(loop)
        self._finish(loop)

    def _build(self) -> Loop:
        """The model, its optimizer, data shard and sync; the resumed state; rank 0's report and first eval."""
        job = self.job
        c = self.config
        t = self.t
        model = Llama(c.model, generator=torch.Generator().manual_seed(t.seed)).to(self.device)
        between = self.transport  # what DiLoCo averages over: the world, or the islands (FSDP2)
        if job.islands is not None:
            between = job.islands(model, shard_model(model, t.fsdp_shards, self.device))
        optimizer = build_inner_optimizer(model, t)
        shard, num_shards = shard_of(t, rank=self.rank, world_size=self.world_size)
        fixed = self.transport is None or self.transport.capabilities.fixed_ranks
        set_worker(f"worker {self.rank}" if fixed else f"peer shard {shard}")
        # of a write this rank's last process left
        RunFolder(job.run_dir).rank(self.rank).remove_stray_temp()
        sampler = BatchSampler(
            job.corpus.shard(shard, num_shards),
            seq_len=c.data.seq_len,
            batch_size=t.batch_size,
            seed=(t.seed * 1_000_003 + shard + 1)
            % (MAX_SEED + 1),  # unchanged where it fits 64 bits
            what=f"shard {shard} of {num_shards} of the training data",
        )
        sync = Sync(
            config=c, model=model, optimizer=optimizer, transport=between, device=self.device
        )
        resumed = self._resume(sync, sampler) if job.resume else 0
        # not resumed: 0, or on a joiner the run's step of the state it took; it trains to train.steps
        step = resumed or sync.start_step
        end = min(t.stop_after, t.steps) if t.stop_after else t.steps
        if not resumed and step:
            log = logger.warning if step >= end else logger.info
            log("joined the run at step %d; this peer ends at step %d", step, end)
        loop = Loop(
            model=model,
            optimizer=optimizer,
            sampler=sampler,
            sync=sync,
            pace=Pace(speed_of(t.speeds, shard)),
            reporter=self._open_report(step, end=end),
            evaluating=evaluates(self.rank, t.fsdp_shards),
            schedule=EvalSchedule(every=t.eval_every or c.diloco.inner_steps, start=step, end=end),
            watch=LossWatch(
                limit=t.max_nonfinite_losses, files=RunFolder(job.run_dir).rank(self.rank), lr=t.lr
            ),
            end=end,
            step=step,
            saved=step,
        )
        # before the loop's clock starts; a joiner's: the swarm's weights it took
        if loop.evaluating and not resumed:
            loss = self._evaluate(sync)
            if loop.reporter is not None:
                loop.reporter.eval(step, loss, seconds=0.0)
        if loop.reporter is not None:
            loop.reporter.start_clock()
        model.train()
        logger.info("training starts at step %d", step)  # a joiner's: its time to the first step
        return loop

    def _open_report(self, step: int, *, end: int) -> Reporter | None:
        """Rank 0's report (metrics.jsonl, the bar, the sinks), which the job closes; None on other ranks."""
        if self.rank != 0:
            return None
        t, run_dir = self.t, self.job.run_dir
        reporter = Reporter(
            run_dir=run_dir,
            world_size=self.world_size,
            start_step=step,
            end_step=end,
            show=self.show,
            sinks=open_sinks(t.log_to, run_dir=run_dir, start_step=step),
        )
        return self.job.outcome.opened(reporter)

    def _step(self, loop: Loop) -> None:
        """One inner step and the round it may end; then, where the run's step moved, what is due at it."""
        t, sync = self.t, loop.sync
        sync.before(loop.step)
        round_before = sync.round
        t0 = time.perf_counter()
        lr = lr_at(sync.position(loop.step), t)
        set_lr(loop.optimizer, lr)
        x, y = loop.sampler.next()
        with autocast(self.device, t.bf16):
            loss = loss_of(
                loop.model,
                x.to(self.device, non_blocking=True),
                y.to(self.device, non_blocking=True),
            )
        loss.backward()
        loop.pace.slow_down(time.perf_counter() - t0)
        comm, report = sync.step(t.grad_clip)
        # rounds by time: the run's progress, which moves only as rounds end
        after = sync.advanced(loop.step)
        moved = after != loop.step
        loop.step = after
        loss_value = loss.item()  # the one host sync per step
        elapsed = time.perf_counter() - t0
        loop.pace.count(elapsed - comm.seconds)
        self.job.outcome.busy(self.rank, loop.pace.busy)
        if loop.reporter is not None:
            if report is not None:
                loop.reporter.round(loop.step, report)
            loop.reporter.step(
                {
                    "type": "step",
                    "step": loop.step,
                    "round": sync.round,
                    "loss": loss_value,
                    "lr": lr,
                    "tokens_per_s": t.batch_size
                    * self.config.data.seq_len
                    * self.world_size
                    / elapsed,
                    "compute_s": elapsed - comm.seconds,
                    "comm_s": comm.seconds,
                    "bytes_sent": comm.bytes_sent,
                    "bytes_received": comm.bytes_received,
                    "time_s": loop.reporter.clock(),
                }
            )
        if moved:
            self._at_new_step(loop, round_before=round_before)
        loop.watch.see(loop.step, loss_value)
        if moved and checkpoint_due(
            loop.step,
            end=loop.end,
            inner_steps=self.config.diloco.inner_steps,
            every=t.checkpoint_every,
        ):
            self._save(loop.step, sync, loop.sampler)
            loop.saved = loop.step

    def _at_new_step(self, loop: Loop, *, round_before: int) -> None:
        """At a step the run moved to: the rounds still in flight applied at the end of training, and the eval
        due (at a round's boundary: where the global weights changed since ``round_before``)."""
        sync = loop.sync
        # the end of training (not a stop_after): apply the rounds still in flight
        if loop.step == self.t.steps:
            sync.flush()  # after the step's record: waiting for the last reduce is not compute
        boundary = sync.diloco is None or sync.round != round_before  # the global weights changed
        if loop.schedule.due(loop.step, boundary=boundary) and loop.evaluating:
            began = time.perf_counter()
            loop.last_eval = self._evaluate(sync)
            if loop.reporter is not None:
                loop.reporter.eval(loop.step, loop.last_eval, seconds=time.perf_counter() - began)

    def _finish(self, loop: Loop) -> None:
        """After the loop: an interrupted run's checkpoint of the step every worker stopped at; rank 0's result."""
        stops, outcome = self.job.stops, self.job.outcome
        # the step all workers stopped at
        if stops.interrupted and not stops.now and loop.step > loop.saved:
            self._save(loop.step, loop.sync, loop.sampler)
        if stops.now or stops.interrupted or not loop.evaluating:
            return
        # resumed at the very end: nothing trained, still report where it stands
        if math.isnan(loop.last_eval):
            loop.last_eval = self._evaluate(loop.sync)
        if loop.reporter is not None:
            busy = outcome.busy_seconds()
            outcome.finished(
                loop.reporter.finish(step=loop.step, eval_after=loop.last_eval, busy=busy)
            )

    def _evaluate(self, sync: Sync) -> float:
        """The validation loss of the run's global weights (``evals``)."""
        with global_weights(sync):
            return evaluate(
                sync.model, val=self.job.corpus.val, config=self.config, device=self.device
            )

    def _resume(self, sync: Sync, sampler: BatchSampler) -> int:
        """Load this worker's checkpoint of the step all ranks resume from; that step (0: none yet). Rank 0
        changes the run folder only once every rank has loaded its checkpoint."""
        job, timeout = self.job, self.config.diloco.reduce_timeout
        found = resume_step(job.run_dir, rank=self.rank, transport=self.transport, timeout=timeout)
        step = found.step
        sync.resumed_at(step)
        if found.state is not None:
            # else group sizes change every round
            fixed = self.transport is None or self.transport.capabilities.fixed_ranks
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
        # files after the step resumed from: never kept
        set_aside(job.run_dir, rank=self.rank, resumed=found)
        if self.rank == 0:
            commit_resume(job.run_dir, step=step, config=self.config, secret_keys=job.secret_keys)
        # -1: crashed (or restarted by torchrun) before its first checkpoint: start over
        return max(step, 0)

    def _save(self, step: int, sync: Sync, sampler: BatchSampler) -> None:
        """Checkpoint ``step``, unless its state holds NaN or inf: then the older checkpoints stay as they are."""
        job, core = self.job, sync.state_dict()
        if not all_finite(core):
            if job.outcome.first_nonfinite_state():
                newest = RunFolder(job.run_dir).rank(self.rank).newest()
                logger.warning(
                    "step %d: the state holds NaN or infinite values: not checkpointed (%s)",
                    step,
                    newest,
                )
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

"""The training loop: DiLoCo, DDP-through-the-transport or a single worker, with metrics and checkpoints.

Workers on the in-process transport are threads of this process; with any other transport this
process is one worker. Only rank 0 writes files (metrics, config, plot) and shows the progress bar;
every rank writes its own checkpoint file, because each holds its own inner optimizer and data order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F

from diloco_core import DiLoCo, RoundReport, Transport, TransportError, codec_for
from diloco_core.config import outer_lr_for
from diloco_core.flat import FlatBuffer
from transports import InProcessGroup, create_transport

from .checkpoint import checkpoint_path, list_checkpoints, load_checkpoint, save_checkpoint
from .config import RunConfig, TrainConfig, dump_toml
from .data import BatchSampler, Corpus, load_corpus
from .model import Llama

__all__ = ["TrainResult", "lr_at", "train", "evaluate"]

logger = logging.getLogger(__name__)

_EVAL_SEED = 1234
_CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    """Where metrics.jsonl, config.toml, plot.png and checkpoints/ were written."""
    steps: int
    """Steps done per worker when the run stopped."""
    eval_before: float
    """Validation loss of the initial weights (from the first run of a resumed run)."""
    eval_after: float
    """Validation loss at the end."""
    wall_seconds: float
    """Seconds of this invocation's training loop (rank 0)."""
    compute_seconds: float
    """Of which rank 0 computed (forward, backward, optimizer steps) rather than communicated."""
    bytes_sent: int
    """Bytes rank 0 put on the wire in this invocation."""
    steps_run: int = 0
    """Steps trained in this invocation (fewer than ``steps`` after a resume)."""
    rounds: int = 0
    """DiLoCo outer rounds in this invocation."""
    round_bytes: int = 0
    """Of ``bytes_sent``, what rank 0 sent in outer rounds (the rest: DDP steps of a warm start)."""


def lr_at(step: int, c: TrainConfig) -> float:
    """Learning rate for the 0-based ``step``: linear warmup, then cosine down to ``lr * min_lr_ratio``."""
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps - 1))
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda" and bf16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss(model: Llama, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def evaluate(model: Llama, val: torch.Tensor, config: RunConfig, device: torch.device) -> float:
    """Mean loss over ``eval_batches`` validation batches, the same windows at every call."""
    t = config.train
    sampler = BatchSampler(val, config.data.seq_len, t.batch_size, _EVAL_SEED, what="validation data")
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(t.eval_batches):
        x, y = sampler.next()
        with _autocast(device, t.bf16):
            total += _loss(model, x.to(device), y.to(device)).item()
    model.train(was_training)
    return total / t.eval_batches


def _device(t: TrainConfig, rank: int) -> torch.device:
    if t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"train.device={t.device!r} but torch sees no CUDA device")
    if t.device.startswith("cuda:"):
        return torch.device(t.device)
    return torch.device("cuda", rank % torch.cuda.device_count())


class _Reporter:
    """Rank 0's output: metrics.jsonl, the progress bar, the summary."""

    def __init__(self, run_dir: Path, config: RunConfig, world_size: int, start_step: int, end_step: int, show: bool):
        self.config = config
        self.world_size = world_size
        self.metrics_path = run_dir / "metrics.jsonl"
        self.file: TextIO = self.metrics_path.open("a", encoding="utf-8")
        self.wall_start = time.perf_counter()
        self.compute = 0.0
        self.comm = 0.0
        self.bytes_sent = 0
        self.steps = 0
        self.rounds = 0
        self.round_bytes = 0
        self.evals: list[float] = []
        self.contributors = world_size
        self.bar = None
        self._rate: float | None = None
        try:
            from tqdm import tqdm
        except ImportError:  # an optional extra: train without the bar rather than fail
            logger.warning("no progress bar: pip install 'diloco[train]'")
            show = False
        if show:
            self.bar = tqdm(total=end_step, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def step(self, record: dict[str, Any]) -> None:
        self.compute += record["compute_s"]
        self.comm += record["comm_s"]
        self.bytes_sent += record["bytes_sent"]
        self.steps += 1
        rate = record["tokens_per_s"]
        self._rate = rate if self._rate is None else 0.9 * self._rate + 0.1 * rate
        self.write(record)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}", tok_s=f"{self._rate:,.0f}", round=record["round"], workers=self.contributors,
                refresh=False,
            )  # fmt: skip
            self.bar.update(1)

    def round(self, record: dict[str, Any]) -> None:
        self.contributors = record["num_contributors"]
        self.rounds += 1
        self.round_bytes += record["bytes_sent"]
        self.write(record)

    def eval(self, step: int, loss: float) -> None:
        self.evals.append(loss)
        self.write({"type": "eval", "step": step, "loss": loss, "perplexity": math.exp(min(loss, 80.0))})
        if self.bar is not None:
            self.bar.write(f"step {step}: eval loss {loss:.4f} (perplexity {math.exp(min(loss, 80.0)):.2f})")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()


class _Shared:
    """What the worker threads of one process share: the stop flag, errors, rank 0's reporter."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.reporter: _Reporter | None = None
        self.result: TrainResult | None = None


def _common_step(transport: Transport | None, steps: list[int], timeout: float) -> int:
    """The newest checkpoint step every rank holds (-1: none). A worker killed mid-checkpoint leaves its
    peers one checkpoint ahead of it; all then resume from the step they have in common."""
    latest = steps[-1] if steps else -1
    if transport is None or transport.world_size == 1:
        return latest
    everyone = []
    for src in range(transport.world_size):
        value = torch.tensor([latest], dtype=torch.int64)
        transport.broadcast([value], src=src, timeout=timeout)
        everyone.append(int(value.item()))
    common = min(everyone)
    if common >= 0 and common not in steps:
        raise ValueError(
            f"workers hold no common checkpoint: their latest steps are {everyone}, and rank {transport.rank} "
            f"has {steps} (keep_checkpoints may be too small)"
        )
    return common


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class _Worker:
    def __init__(
        self,
        rank: int,
        world_size: int,
        transport: Transport | None,
        config: RunConfig,
        corpus: Corpus,
        run_dir: Path,
        resume: bool,
        shared: _Shared,
        show_progress: bool,
    ) -> None:
        self.rank, self.world_size, self.transport = rank, world_size, transport
        self.config, self.corpus, self.run_dir, self.resume, self.shared = config, corpus, run_dir, resume, shared
        self.show_progress = show_progress
        self.t = config.train
        self.device = _device(self.t, rank)

    def run(self) -> None:
        c, t = self.config, self.t
        timeout = c.diloco.reduce_timeout
        wire = codec_for(c.diloco.wire_dtype)  # DDP's gradients travel as DiLoCo's pseudo-gradients would
        model = Llama(c.model, generator=torch.Generator().manual_seed(t.seed)).to(self.device)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2),
        )  # fmt: skip
        shard, num_shards = _shard_of(t, self.rank, self.world_size)
        sampler = BatchSampler(
            self.corpus.shard(shard, num_shards), c.data.seq_len, t.batch_size,
            seed=t.seed * 1_000_003 + shard + 1, what=f"shard {shard} of {num_shards} of the training data",
        )  # fmt: skip
        params = [p for p in model.parameters() if p.requires_grad]
        diloco: DiLoCo | None = None
        grads: FlatBuffer | None = None
        warm = t.ddp_warm_start if t.mode == "diloco" else 0  # DDP steps before DiLoCo takes over
        if t.mode == "diloco" and not warm:
            diloco = self._diloco(model, optimizer)  # a joiner takes the run's outer state here
        elif t.mode != "single":
            assert self.transport is not None
            with torch.no_grad():
                self.transport.broadcast(params, src=0, timeout=timeout)
            grads = FlatBuffer(params, self.device)

        ckpt_dir = self.run_dir / "checkpoints"
        step = 0
        if self.resume:
            steps = list_checkpoints(ckpt_dir, self.rank)
            step = steps[-1] if steps else -1
            if self.transport is None or self.transport.fixed_ranks:  # peers that come and go have no ranks to agree
                step = _common_step(self.transport, steps, timeout)
            if warm and step > warm:  # the checkpoint is past the warm start: it holds DiLoCo's state
                diloco, grads = self._diloco(model, optimizer), None
            if step >= 0:
                if self.rank == 0:  # drop what was logged after the checkpoint all ranks resume from
                    _truncate_metrics(self.run_dir, step)
                state = load_checkpoint(checkpoint_path(ckpt_dir, step, self.rank))
                self._load(state, model, optimizer, diloco, sampler)
                logger.info("rank %d: resumed from step %d", self.rank, step)
            else:  # crashed (or restarted by torchrun) before its first checkpoint: start over
                step = 0
                logger.warning("rank %d: run %s has no checkpoint yet; starting from step 0", self.rank, self.run_dir)

        end = min(t.stop_after, t.steps) if t.stop_after else t.steps
        h = c.diloco.inner_steps
        eval_every = t.eval_every or h
        reporter: _Reporter | None = None
        if self.rank == 0:
            reporter = _Reporter(self.run_dir, c, self.world_size, step, end, self.show_progress)
            self.shared.reporter = reporter
            if step == 0:
                reporter.eval(0, evaluate(model, self.corpus.val, c, self.device))
        tokens = t.batch_size * c.data.seq_len
        wall_start = time.perf_counter()
        last_eval = math.nan
        model.train()
        while step < end and not self.shared.stop.is_set():
            if warm and step == warm and diloco is None:  # the warm start is over: DiLoCo from these weights
                diloco, grads = self._diloco(model, optimizer), None
            t0 = time.perf_counter()
            lr = lr_at(step, t)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = sampler.next()
            with _autocast(self.device, t.bf16):
                loss = _loss(model, x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            loss.backward()
            comm = 0.0
            sent = received = 0
            report: RoundReport | None = None
            if grads is not None:
                assert self.transport is not None
                with torch.no_grad():
                    grads.copy_from([p.grad for p in params])
                    result = self.transport.all_reduce([grads.flat], codec=wire, key="ddp/grads").wait(timeout)
                    grads.copy_to([p.grad for p in params])
                comm, sent, received = result.seconds, result.bytes_sent, result.bytes_received
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            if diloco is not None:
                report = diloco.step()
                if report is not None:
                    comm, sent, received = report.comm_seconds, report.bytes_sent, report.bytes_received
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_value = loss.item()  # the one host sync per step
            elapsed = time.perf_counter() - t0
            if reporter is not None:
                if report is not None:
                    reporter.round({
                        "type": "round", "step": step, "round": report.round, "num_contributors": report.num_contributors,
                        "bytes_sent": report.bytes_sent, "bytes_received": report.bytes_received,
                        "comm_s": report.comm_seconds, "round_s": report.round_seconds,
                        "pseudo_grad_norm": report.pseudo_grad_norm,
                        "mean_pseudo_grad_norm": report.mean_pseudo_grad_norm, "agreement": report.agreement,
                    })  # fmt: skip
                reporter.step({
                    "type": "step", "step": step, "round": diloco.round if diloco is not None else 0,
                    "loss": loss_value, "lr": lr,
                    "tokens_per_s": tokens * self.world_size / elapsed, "compute_s": elapsed - comm, "comm_s": comm,
                    "bytes_sent": sent, "bytes_received": received, "time_s": time.perf_counter() - wall_start,
                })  # fmt: skip
                if step % eval_every == 0 or step == end:
                    last_eval = evaluate(model, self.corpus.val, c, self.device)
                    reporter.eval(step, last_eval)
            if step == end or (t.checkpoint_every and step % h == 0 and (step // h) % t.checkpoint_every == 0):
                self._save(step, model, optimizer, diloco, sampler)
        if self.shared.stop.is_set():
            return
        if reporter is not None:
            if math.isnan(last_eval):  # resumed at the very end: nothing trained, still report where it stands
                last_eval = evaluate(model, self.corpus.val, c, self.device)
            wall = time.perf_counter() - wall_start
            history = [r for r in _read_metrics(reporter.metrics_path) if r.get("type") == "eval"]
            before = history[0]["loss"] if history else math.nan
            self.shared.result = TrainResult(
                run_dir=self.run_dir, steps=step, eval_before=before, eval_after=last_eval, wall_seconds=wall,
                compute_seconds=reporter.compute, bytes_sent=reporter.bytes_sent, steps_run=reporter.steps,
                rounds=reporter.rounds, round_bytes=reporter.round_bytes,
            )  # fmt: skip
            reporter.write({
                "type": "summary", "step": step, "wall_s": wall, "compute_s": reporter.compute, "comm_s": reporter.comm,
                "utilization": reporter.compute / wall if wall else 0.0, "bytes_sent": reporter.bytes_sent,
                "eval_before": before, "eval_after": last_eval,
            })  # fmt: skip

    def _diloco(self, model: Llama, optimizer: torch.optim.Optimizer) -> DiLoCo:
        """DiLoCo over this worker's model. An unset outer lr is the core's rule for the transport's world size;
        peers that come and go have none up front, so the rule takes the number of data shards there."""
        assert self.transport is not None
        c = self.config.diloco
        if c.outer_lr is None and not self.transport.fixed_ranks:
            c = replace(c, outer_lr=outer_lr_for(max(self.t.num_shards, 1), c.outer_momentum))
        return DiLoCo(model, optimizer, self.transport, c)

    def _save(self, step: int, model: Llama, optimizer: torch.optim.Optimizer, diloco: DiLoCo | None,
              sampler: BatchSampler) -> None:  # fmt: skip
        if diloco is not None:
            core: dict[str, Any] = diloco.state_dict()
        else:
            core = {"model": [p.detach() for p in model.parameters()], "inner_optimizer": optimizer.state_dict()}
        state = {
            "format": _CHECKPOINT_FORMAT, "mode": self.t.mode, "rank": self.rank, "world_size": self.world_size,
            "step": step, "core": core, "data": sampler.state_dict(),
        }  # fmt: skip
        save_checkpoint(self.run_dir / "checkpoints", step, self.rank, state, self.t.keep_checkpoints)

    def _load(self, state: dict[str, Any], model: Llama, optimizer: torch.optim.Optimizer, diloco: DiLoCo | None,
              sampler: BatchSampler) -> None:  # fmt: skip
        if state.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint format {state.get('format')!r} is not {_CHECKPOINT_FORMAT}")
        fixed = self.transport is None or self.transport.fixed_ranks  # else group sizes change from round to round
        if state["mode"] != self.t.mode or (fixed and state["world_size"] != self.world_size):
            raise ValueError(
                f"the checkpoint is of a {state['mode']} run with {state['world_size']} worker(s); "
                f"this run is {self.t.mode} with {self.world_size}"
            )
        core = state["core"]
        if diloco is not None and diloco.joined:
            # The swarm's global params, outer momentum and round are newer than this checkpoint:
            # take only what is this peer's own, its inner optimizer (and its data position, below).
            optimizer.load_state_dict(core["inner_optimizer"])
        elif diloco is not None:
            diloco.load_state_dict(core)
        else:
            with torch.no_grad():
                torch._foreach_copy_(list(model.parameters()), [t.to(self.device) for t in core["model"]])
            optimizer.load_state_dict(core["inner_optimizer"])
        sampler.load_state_dict(state["data"])


def _prepare_run_dir(run_dir: Path, config: RunConfig, resume: bool) -> None:
    metrics = run_dir / "metrics.jsonl"
    if resume:
        if not list_checkpoints(run_dir / "checkpoints", 0):
            metrics.unlink(missing_ok=True)  # nothing to resume: what was logged is from a run that starts over
    elif metrics.exists() or (run_dir / "checkpoints").exists():
        raise ValueError(f"run {str(run_dir)!r} already exists: pass --resume to continue it, or another --name")
    run_dir.mkdir(parents=True, exist_ok=True)
    tables = config.to_dict()
    tables["transport"] = {k: v for k, v in tables["transport"].items() if k != "secret"}  # never on disk
    (run_dir / "config.toml").write_text(dump_toml(tables), encoding="utf-8")


def _check_resume_workers(run_dir: Path, world_size: int) -> None:
    """In-process: every worker's checkpoint is on this disk, so a changed worker count is caught up front."""
    folder = run_dir / "checkpoints"
    have = 0
    while list_checkpoints(folder, have):
        have += 1
    if have != world_size:
        raise ValueError(
            f"run {str(run_dir)!r} was checkpointed with {have} worker(s); "
            f"this run has {world_size} (set train.workers={have}, or start a new run)"
        )


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop what a crashed or stopped run logged after the checkpoint it resumes from."""
    path = run_dir / "metrics.jsonl"
    keep = [r for r in _read_metrics(path) if r.get("type") != "summary" and r.get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
    os.replace(tmp, path)


def _resolve_model(config: RunConfig, corpus: Corpus) -> RunConfig:
    if config.model.vocab_size is not None and config.model.vocab_size < corpus.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's {corpus.vocab_size}"
        )
    return replace(config, model=config.model.resolved(vocab_size=corpus.vocab_size))


def _shard_of(t: TrainConfig, rank: int, world_size: int) -> tuple[int, int]:
    """(shard, number of shards) of a worker: its rank, unless train.shard names one (hivemind has no ranks)."""
    if t.shard >= 0:
        return t.shard, t.num_shards
    return rank, t.num_shards or world_size


def _check_data(config: RunConfig, corpus: Corpus, world_size: int) -> None:
    """Fail before any thread starts when a shard or the validation set is too small for a batch."""
    t, seq = config.train, config.data.seq_len
    BatchSampler(corpus.val, seq, t.batch_size, 0, what="the validation data")
    for rank in range(world_size):
        shard, n = _shard_of(t, rank, world_size)
        if shard >= n:
            raise ValueError(f"train.num_shards={n} is too small for worker {rank}: shard {shard} does not exist")
        BatchSampler(corpus.shard(shard, n), seq, t.batch_size, 0, what=f"shard {shard} of {n} of the training data")


def train(
    config: RunConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    command: list[str] | None = None,
) -> TrainResult:
    """Train as ``config`` says, writing into ``run_dir``. ``command``: argv shown to hivemind peers to join."""
    run_dir = Path(run_dir)
    t = config.train
    kind = config.transport.get("kind", "inprocess")
    if t.mode == "single" and kind != "inprocess":
        raise ValueError(f"train.mode='single' runs one worker in one process; [transport] kind={kind!r} needs ddp or diloco")
    corpus = load_corpus(config.data)
    config = _resolve_model(config, corpus)
    local_workers = 1 if t.mode == "single" or kind != "inprocess" else t.workers
    # Workers sharing this machine's cores: threads here, or torchrun's processes on this node.
    # Oversubscribed cores make every OpenMP region wait on a busy core (seen: 10x slower steps).
    on_machine = local_workers if kind == "inprocess" else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(t.threads or max(1, (os.cpu_count() or 1) // on_machine))

    shared = _Shared()
    if kind == "hivemind" and t.mode != "single" and (t.shard < 0 or t.num_shards < 1):
        raise ValueError(
            "hivemind peers have no fixed ranks: give each peer its own data shard with "
            "train.shard=K and train.num_shards=N (0 <= K < N), or all peers train on the same data"
        )
    if kind == "inprocess" and (t.shard >= 0 or t.num_shards):
        raise ValueError("train.shard and train.num_shards are for one-worker-per-process transports; in-process "
                         "workers take their rank's shard")
    if kind == "inprocess":
        _check_data(config, corpus, local_workers)
        _prepare_run_dir(run_dir, config, resume)
        if resume and list_checkpoints(run_dir / "checkpoints", 0):
            _check_resume_workers(run_dir, local_workers)
        if local_workers == 1 and t.mode == "single":
            _Worker(0, 1, None, config, corpus, run_dir, resume, shared, show_progress).run()
        else:
            _run_threads(config, corpus, run_dir, resume, shared, show_progress, local_workers)
    else:
        transport = create_transport(config.transport)
        try:
            rank, world = transport.rank, transport.world_size
            _check_data(config, corpus, world)
            if rank == 0:
                _prepare_run_dir(run_dir, config, resume)
                _print_join(transport, command)
            _Worker(rank, world, transport, config, corpus, run_dir, resume, shared, show_progress and rank == 0).run()
        finally:
            transport.close()
            if shared.reporter is not None:
                shared.reporter.close()
        if rank != 0:
            return TrainResult(run_dir=run_dir, steps=t.steps, eval_before=math.nan, eval_after=math.nan,
                               wall_seconds=0.0, compute_seconds=0.0, bytes_sent=0)  # fmt: skip
    if shared.reporter is not None:
        shared.reporter.close()
    assert shared.result is not None
    _plot(run_dir)
    return shared.result


def _run_threads(
    config: RunConfig, corpus: Corpus, run_dir: Path, resume: bool, shared: _Shared, show: bool, world: int
) -> None:
    group = InProcessGroup(world)
    transports = [group.transport(r) for r in range(world)]

    def work(rank: int) -> None:
        try:
            _Worker(rank, world, transports[rank], config, corpus, run_dir, resume, shared, show).run()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
            shared.errors.append(e)
            shared.stop.set()
        finally:
            # Leaving the group releases the others from any collective that waits on this rank.
            transports[rank].close()

    threads = [threading.Thread(target=work, args=(r,), name=f"diloco-worker-{r}", daemon=True) for r in range(world)]
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.2)
    except KeyboardInterrupt:
        shared.stop.set()
        for th in threads:
            th.join(30)
        raise
    finally:
        if shared.reporter is not None and shared.errors:
            shared.reporter.close()
    if shared.errors:
        # The first error is the cause; the others are usually transports failing because of it.
        first = next((e for e in shared.errors if not isinstance(e, TransportError)), shared.errors[0])
        raise first


def _print_join(transport: Transport, command: list[str] | None) -> None:
    addresses = getattr(transport, "join_addresses", None)
    if not addresses:
        return
    argv = list(command or ["diloco", "train"])
    argv += ["--set", f"transport.initial_peers={json.dumps(list(addresses))}"]
    print(
        "other peers join with (each with its own train.shard=K and train.num_shards=N for a disjoint data shard):\n  "
        + shlex.join(argv), file=sys.stderr, flush=True,
    )  # fmt: skip


def _plot(run_dir: Path) -> None:
    try:
        from .plot import plot_runs

        plot_runs([run_dir], run_dir / "plot.png")
    except ImportError as e:  # matplotlib is an optional extra
        logger.warning("no plot written (%s): pip install 'diloco[train]'", e)


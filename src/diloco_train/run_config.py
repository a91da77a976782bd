"""The trainer's configuration: TOML sections, each mapped to one frozen dataclass, plus ``--set`` overrides."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomli_w
import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package (a dependency there)
    import tomli as tomllib

from diloco_core import CODECS, DiLoCoConfig
from diloco_core.config import codec_from_alias
from diloco_core.rules import boolean, check_field, check_fields, choice, from_mapping, integer, number, rule, string
from transports import transport_spec

from .data.corpus import DataConfig
from .model import ModelConfig

__all__ = [
    "MODES",
    "SECTIONS",
    "TRAINER_DEFAULTS",
    "RunConfig",
    "TrainConfig",
    "build_config",
    "dump_toml",
    "load_toml",
    "parse_override",
]

MODES = ("diloco", "ddp", "single")
WARM_START_SYNCS = ("gradients", "updates")
INNER_OPTIMIZERS = ("adamw", "muon")
SINKS = ("tensorboard", "wandb")  # sinks.py writes them
MAX_SEED = 2**64 - 1  # torch.Generator's seeds are 64-bit: above, "Overflow when unpacking long long"


def _is_speed(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1


def _is_device(v: object) -> bool:
    return isinstance(v, str) and (v in ("auto", "cpu", "cuda") or v.startswith("cuda:"))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    mode: str = field(default="diloco", metadata=choice(MODES))
    """diloco (outer round every diloco.inner_steps), ddp (gradients averaged every step) or single (one worker)."""
    workers: int = field(default=4, metadata=integer(low=1))
    """Workers as threads of this process (in-process transport). Other transports: one worker per process."""
    steps: int = field(default=600, metadata=integer(low=1))
    """Inner steps per worker in total; the learning-rate schedule spans them."""
    batch_size: int = field(default=32, metadata=integer(low=1))
    """Sequences per step per worker. DiLoCo needs enough of them per worker step: with 64-byte windows it
    ended 8.6% above DDP at 8, 6.4% at 16 (docs/results.md, which also has this default's figure)."""
    inner_optimizer: str = field(default="adamw", metadata=choice(INNER_OPTIMIZERS))
    """adamw, or muon: torch's Muon for the decoder blocks' matrices (attention and MLP) at ``muon_lr``, AdamW
    for the embeddings, the output head and the norms at ``lr`` (diloco_train.inner_optimizer)."""
    lr: float = field(default=1e-3, metadata=number(gt=0, noun="a finite number"))
    """Peak learning rate of the inner AdamW (the papers use 4e-4 for 150M+; the tiny model trains faster at 1e-3)."""
    muon_lr: float = field(default=0.02, metadata=number(gt=0, noun="a finite number"))
    """inner_optimizer = "muon": peak learning rate of Muon's matrices, on ``lr``'s warmup and cosine (Keller
    Jordan's 0.02, torch's default scaling). At ``lr`` with torch's "match_rms_adamw" scaling (meant to reuse
    AdamW's lr) the tiny model ended 8% above AdamW, at 0.02 10% below it (docs/trainer.md, "Inner optimizer")."""
    min_lr_ratio: float = field(default=0.1, metadata=number(ge=0, le=1))
    """The cosine decays the learning rate to lr * min_lr_ratio at the last step."""
    warmup_steps: int = field(default=50, metadata=integer(low=0))
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = field(default=0.1, metadata=number(ge=0))
    """Weight decay of the matrices: each step multiplies them by 1 - lr * weight_decay (AdamW's decoupled decay;
    Muon's matrices decay at that same rate, whatever ``muon_lr``)."""
    beta1: float = field(default=0.9, metadata=number(ge=0, lt=1))
    """AdamW beta1."""
    beta2: float = field(default=0.95, metadata=number(ge=0, lt=1))
    """AdamW beta2."""
    grad_clip: float = field(default=1.0, metadata=number(ge=0))
    """Clip the gradient norm to this (0: no clipping)."""
    ddp_warm_start: int | None = field(default=None, metadata=integer(low=0, unset=True, valid="an integer >= 0"))
    """diloco mode: steps of DDP (gradients averaged every step) before the first DiLoCo round starts. None: a
    twelfth of ``steps`` (50 of the default run's 600) where the transport's ranks are fixed (in-process, torch),
    0 where peers come and go (hivemind: a joiner could not take part in a DDP phase)."""
    ddp_wire_dtype: str | None = field(
        default=None, metadata=rule(lambda v: v is None or v in CODECS, f"one of {sorted(CODECS)}")
    )
    """The wire of DDP's gradients (ddp mode, diloco's warm start): a codec name as ``diloco.codec``. None: fp32 in
    ddp mode; in diloco's warm start the rounds' ``diloco.codec`` (int4 by default; int4 where they are sign or topk):
    at 100 Mbit/s an fp32 warm start was 36 s of the old default's 78 s to DDP's loss; an int4 one reached that
    loss at the same step on 2 of 3 seeds, 40 steps later on the third (docs/results.md, "Time to a target loss")."""
    warm_start_sync: str = field(default="gradients", metadata=choice(WARM_START_SYNCS))
    """What diloco's warm start averages every step: ``gradients`` (DDP: one AdamW step on the mean gradient) or
    ``updates`` (each worker's own AdamW step, then the mean of the workers' weights: DiLoCo with H = 1 and
    an outer SGD of lr 1 without momentum, on ``ddp_wire_dtype`` with ``ddp_error_feedback``). A 1-bit wire
    (``sign``) loses 3.4% on gradients, where AdamW's second moment takes in its noise (docs/results.md)."""
    ddp_error_feedback: bool = field(default=True, metadata=boolean())
    """With a lossy ``ddp_wire_dtype``: each worker adds what the codec dropped of its last gradient to its next
    one (in ddp mode's checkpoints; a warm start's residual ends with it, when DiLoCo takes over)."""
    seed: int = field(default=0, metadata=integer(low=0, high=MAX_SEED))
    """Seed of the weights (rank 0's, broadcast to all) and of every worker's data order (64-bit)."""
    eval_every: int = field(default=0, metadata=integer(low=0))
    """Evaluate on validation every this many steps (0: every diloco.inner_steps), at the first round boundary at
    or after each multiple, on the run's global weights (diloco_train.evals)."""
    eval_batches: int = field(default=8, metadata=integer(low=1))
    """Validation batches per evaluation (the same windows every time)."""
    checkpoint_every: int = field(default=10, metadata=integer(low=0))
    """Checkpoint every this many rounds (of diloco.inner_steps steps, in every mode) and at the end; 0: only at the end."""
    keep_checkpoints: int = field(default=2, metadata=integer(low=1))
    """Checkpoints kept per worker; older ones are deleted."""
    max_nonfinite_losses: int = field(default=3, metadata=integer(low=1))
    """Stop with an error once a worker's loss is NaN or infinite at this many steps in a row (its weights then
    are too: nothing trains on). A state that is not finite is never checkpointed."""
    stop_after: int = field(default=0, metadata=integer(low=0))
    """Stop (after a checkpoint) once this many steps are done, schedule unchanged; resume later. 0: run all steps."""
    shard: int = field(default=-1, metadata=integer(low=-1, valid="an integer >= 0 (or -1: the rank)"))
    """This process's data shard when the transport has no fixed ranks (hivemind: give each peer its own). -1: its rank."""
    num_shards: int = field(default=0, metadata=integer(low=0))
    """Number of data shards for ``shard``. 0: the transport's world size."""
    fsdp_shards: int = field(default=1, metadata=integer(low=1))
    """diloco mode under torchrun: ranks per island, which shard one model with FSDP2 (``fully_shard``) and
    train it as one DiLoCo worker; DiLoCo averages across the world size / fsdp_shards islands, each rank
    its own shards (docs/lan.md). 1: every process holds the whole model."""
    device: str = field(default="auto", metadata=rule(_is_device, "auto, cpu, cuda or cuda:N"))
    """cpu, cuda, cuda:N or auto (cuda if available). In-process workers on cuda spread over the visible GPUs."""
    bf16: bool = field(default=True, metadata=boolean())
    """bf16 autocast for the forward pass on cuda (ignored on cpu)."""
    speeds: tuple[float, ...] = field(
        default=(),
        metadata=rule(
            lambda v: isinstance(v, (list, tuple)) and all(_is_speed(s) for s in v), "a list of numbers in (0, 1]"
        ),
    )
    """Simulated worker speeds (docs/elastic.md): worker r (its data shard where peers come and go) runs at
    ``speeds[r % len(speeds)]``, waiting (1/speed - 1) times each step's compute. Empty: every worker at 1."""
    threads: int = field(default=0, metadata=integer(low=0))
    """torch intra-op threads for this process (0: CPU cores // in-process workers, at least 1)."""
    runs_dir: str = field(default="runs", metadata=string(empty=False, valid="a non-empty path"))
    """Runs are written to <runs_dir>/<name>/."""
    log_to: tuple[str, ...] = field(
        default=(),
        metadata=rule(
            lambda v: isinstance(v, (list, tuple)) and all(s in SINKS for s in v) and len(set(v)) == len(v),
            f"a list of distinct names from {SINKS}",
        ),
    )
    """Also log the metrics records to: "tensorboard" (event files in <run>/tensorboard/), "wandb" (each an
    extra, docs/trainer.md). Empty: metrics.jsonl only."""

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "speeds", tuple(float(s) for s in self.speeds))
        object.__setattr__(self, "log_to", tuple(self.log_to))
        ok = self.fsdp_shards == 1 or (self.mode == "diloco" and not self.ddp_warm_start)
        check_field("fsdp_shards", self.fsdp_shards, ok, "1, or in diloco mode without ddp_warm_start any N >= 1")
        # torch's Muon orthogonalizes whole matrices: on FSDP2's row shards (DTensor) every step would gather them
        ok = self.fsdp_shards == 1 or self.inner_optimizer == "adamw"
        valid = f"adamw with fsdp_shards={self.fsdp_shards} (muon: whole matrices, fsdp_shards=1)"
        check_field("inner_optimizer", self.inner_optimizer, ok, valid)
        ok = self.inner_optimizer != "muon" or hasattr(torch.optim, "Muon")  # torch >= 2.9
        check_field("inner_optimizer", self.inner_optimizer, ok, f"adamw: torch {torch.__version__} has no Muon")
        # None: the default, a twelfth of the steps where ranks are fixed (modes.warm_start_steps)
        w = self.ddp_warm_start
        ok = not w or (self.mode == "diloco" and w < self.steps)
        check_field("ddp_warm_start", w, ok, f"0, or in diloco mode a step count below steps={self.steps}")
        ok = self.shard < max(self.num_shards, 1) if self.num_shards else self.shard <= 0
        check_field("shard", self.shard, ok, f"below num_shards={self.num_shards} (set num_shards with shard)")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """[model]: the network's shape."""
    data: DataConfig = field(default_factory=DataConfig)
    """[data]: corpus, split and window length."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """[train]: mode, workers, schedule, evaluation, checkpoints."""
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    """[diloco]: the outer loop (diloco_core.DiLoCoConfig)."""
    transport: dict[str, Any] = field(default_factory=lambda: dict(transport_spec({}).section))
    """[transport]: ``kind`` plus that transport's fields, handed to transports.transport_spec."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section as a table of its values, unset (None) values and ``train.stop_after`` left out.

        ``stop_after`` belongs to one invocation, not to the run: a run resumed from its saved config
        goes on to ``train.steps``.
        """
        out = {name: asdict(getattr(self, name)) for name in ("model", "data", "train", "diloco")}
        out["train"].pop("stop_after")
        out["transport"] = dict(self.transport)
        return {s: {k: v for k, v in t.items() if v is not None} for s, t in out.items()}


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "diloco": DiLoCoConfig}

# The trainer's own defaults where they differ from a component's: the paper's H = 500 would give a
# CPU run of a few hundred steps no round at all. H = 10 won the sweep; int4 with error feedback ended
# within the seeds' noise of fp32 on the convergence table at 7.8x fewer bytes per round, which pays for
# the default DDP warm start (train.ddp_warm_start) and keeps the default run >= 10x below DDP's traffic
# (docs/results.md).
TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {"diloco": {"inner_steps": 10, "codec": "int4"}}


def load_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file (tomllib on Python 3.11+, tomli before)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"config file {str(path)!r} is a directory") from None
    except UnicodeDecodeError as e:  # a TOML file is UTF-8 text
        bad = f"byte {e.object[e.start]:#04x} at offset {e.start}"
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text: {bad}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); value is read as a TOML literal, else kept as a string."""
    try:  # a command line's bytes that are not UTF-8 come as surrogates, which no file could hold
        text.encode("utf-8")
    except UnicodeEncodeError:
        bad = "\\udcXX is a byte 0xXX that is not UTF-8"
        raise ValueError(f"--set {text!r} is invalid: expected UTF-8 text ({bad})") from None
    target, sep, raw = text.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot or not section or not key or "." in key:
        raise ValueError(f"--set {text!r} is invalid: expected section.key=value, e.g. train.steps=100")
    valid = [*SECTIONS, "transport"]
    if section not in valid:
        raise ValueError(f"--set {text!r}: unknown section [{section}]; valid sections: {valid}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:  # not a TOML literal: a bare word is a string
        value = raw.strip()
    return section, key, value


def _merge(base: dict[str, dict[str, Any]], update: Mapping[str, Any], where: str) -> None:
    valid = [*SECTIONS, "transport"]
    for section, table in update.items():
        if section not in valid:
            raise ValueError(f"unknown section [{section}] in {where}; valid sections: {valid}")
        if not isinstance(table, Mapping):
            raise ValueError(f"[{section}] in {where} must be a table of key = value, got {type(table).__name__}")
        if section == "diloco" and "wire_dtype" in table:  # renamed within its layer, so a later layer's codec wins
            table = _renamed(table, where)
        base.setdefault(section, {}).update(table)


def _renamed(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A [diloco] table with the deprecated ``wire_dtype`` as ``codec`` (``ValueError`` where both disagree)."""
    renamed = {k: v for k, v in table.items() if k != "wire_dtype"}
    codec = codec_from_alias(table["wire_dtype"], stacklevel=4)
    if renamed.setdefault("codec", codec) != codec:
        raise ValueError(f"[diloco] in {where}: codec={renamed['codec']!r} and wire_dtype={codec!r} disagree")
    return renamed


def build_config(
    files: Sequence[str | Path] = (), overrides: Sequence[str] = (), base: Mapping[str, Any] | None = None
) -> RunConfig:
    """Trainer defaults, then ``base`` (e.g. a run's saved config), then each TOML file, then ``--set`` overrides."""
    tables: dict[str, dict[str, Any]] = {s: dict(t) for s, t in TRAINER_DEFAULTS.items()}
    if base is not None:
        _merge(tables, base, "the saved config")
    for f in files:
        _merge(tables, load_toml(f), str(f))
    for text in overrides:
        section, key, value = parse_override(text)
        _merge(tables, {section: {key: value}}, f"--set {text!r}")
    sections = {name: from_mapping(cls, tables.get(name, {}), name) for name, cls in SECTIONS.items()}
    # The factory checks the kind and what a launch of it takes, and fills in the default kind.
    transport = dict(transport_spec(tables.get("transport", {})).section)
    return RunConfig(transport=transport, **sections)


def dump_toml(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """Tables of scalars (and lists of them) as TOML text that ``load_toml`` reads back unchanged. TOML has no
    null: a None is a ValueError (``RunConfig.to_dict`` leaves unset values out)."""
    try:
        return tomli_w.dumps(tables)
    except TypeError as e:
        raise ValueError(f"cannot write to TOML: {e}") from None

"""Joining a torch.distributed process group: the transport's config and the group's initialization."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from diloco_core.rules import check_field, check_fields, choice, number, rule, string

from .wire_bytes import Path

__all__ = ["BACKEND_DEVICE", "TorchDistConfig", "init_process_group"]

BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


@dataclass(frozen=True, kw_only=True)
class TorchDistConfig:
    backend: str = field(default="gloo", metadata=choice(sorted(BACKEND_DEVICE)))
    """gloo for CPU tensors, nccl for CUDA tensors (then set the core's global_device to "cuda")."""
    init_method: str = field(default="env://", metadata=string(valid="a URL such as env://"))
    """Where ranks meet when no process group exists yet; env:// reads torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT."""
    timeout: float = field(default=600.0, metadata=number(gt=0, noun="a number of seconds"))
    """Seconds any collective may take before the process group fails it (a dead peer's bound). At most
    the core's ``reduce_timeout`` (DiLoCo checks); the trainer derives it from ``[diloco] reduce_timeout``
    when it is not set."""
    bucket_mb: float = field(default=8.0, metadata=number(gt=0, noun="a number of MB"))
    """Size of the buckets a reduce is split into, in MB of fp32: few large collectives, pipelined."""
    path: str = field(default="auto", metadata=choice(["auto", "gather", "scatter-gather"]))
    """How a codec other than fp32 moves: "gather" (each payload to every peer, each rank merges them all),
    "scatter-gather" (shard payloads all-to-all, fp32 shard sums all-gathered), or "auto": whichever sends
    fewer bytes (``wire_bytes.path_of``). Every rank must set the same (a reduce's header checks it)."""
    secret: str | None = field(default=None, repr=False)
    """The run's shared secret: every rank must hold the same one, or the group refuses to start
    (``membership``; docs/lan.md, "Members only"). Never saved with the run. Prefer ``secret_file`` or the
    DILOCO_TORCH_SECRET environment variable (used when neither key is set): a ``--set`` value is in the
    command line, which every user of the machine can read. None: no secret, unless the variable is set."""
    secret_file: str | None = field(
        default=None,
        metadata=rule(lambda v: v is None or (isinstance(v, str) and v != ""), "a path or none"),
    )
    """A file holding the run's secret (its content, stripped), readable by its owner only (chmod 600)."""

    @property
    def narrow(self) -> Path | None:
        """``path`` as the transport takes it (``TorchDistTransport(narrow=)``): None for "auto"."""
        return None if self.path == "auto" else Path(self.path)

    def __post_init__(self) -> None:
        check_fields(self)
        # by hand: never shown
        ok = self.secret is None or (isinstance(self.secret, str) and self.secret != "")
        check_field(
            "secret", "<hidden>" if ok else self.secret, ok=ok, valid="a non-empty string or none"
        )


def init_process_group(config: TorchDistConfig) -> None:
    """Join the default process group as ``config`` says (torchrun's env:// unless told otherwise)."""
    if config.init_method == "env://":
        missing = [
            v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
        ]
        if missing:
            raise ValueError(
                f"transport kind 'torch' needs a process group: launch with torchrun (it sets {missing}) "
                "or set [transport] init_method"
            )
    if config.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend='nccl' needs CUDA, and torch.cuda.is_available() is False; use backend='gloo'"
        )
    timeout = datetime.timedelta(seconds=config.timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if config.init_method == "env://" and attempt is not None:
        # After torchrun restarts the workers (--max-restarts) they meet in the same store as before,
        # where the killed group's keys still stand: gloo then dials the dead workers' addresses
        # ("Connection refused") or waits for them. Each attempt gets keys of its own.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=rank == 0 and not agent_store,
            timeout=timeout,
        )
        prefixed = dist.PrefixStore(f"diloco/attempt_{attempt}", store)
        dist.init_process_group(
            config.backend, store=prefixed, rank=rank, world_size=world, timeout=timeout
        )
        return
    dist.init_process_group(config.backend, init_method=config.init_method, timeout=timeout)

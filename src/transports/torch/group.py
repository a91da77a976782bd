"""Joining a torch.distributed process group: the transport's config and the group's initialization."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diloco_core.config import check_field, is_finite_number

__all__ = ["BACKEND_DEVICE", "TorchDistConfig", "init_process_group"]

BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


@dataclass(frozen=True, kw_only=True)
class TorchDistConfig:
    backend: str = "gloo"
    """gloo for CPU tensors, nccl for CUDA tensors (then set the core's global_device to "cuda")."""
    init_method: str = "env://"
    """Where ranks meet when no process group exists yet; env:// reads torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT."""
    timeout: float = 600.0
    """Seconds any collective may take before the process group fails it (a dead peer's bound). At most
    the core's ``reduce_timeout`` (DiLoCo checks); the trainer derives it from ``[diloco] reduce_timeout``
    when it is not set."""
    bucket_mb: float = 8.0
    """Size of the buckets a reduce is split into, in MB of fp32: few large collectives, pipelined."""

    def __post_init__(self) -> None:
        check_field("backend", self.backend, self.backend in BACKEND_DEVICE, f"one of {sorted(BACKEND_DEVICE)}")
        check_field("init_method", self.init_method, isinstance(self.init_method, str), "a URL such as env://")
        check_field(
            "timeout", self.timeout, is_finite_number(self.timeout) and self.timeout > 0, "a number of seconds > 0"
        )
        check_field(
            "bucket_mb", self.bucket_mb, is_finite_number(self.bucket_mb) and self.bucket_mb > 0, "a number of MB > 0"
        )


def init_process_group(config: TorchDistConfig) -> None:
    """Join the default process group as ``config`` says (torchrun's env:// unless told otherwise)."""
    if config.init_method == "env://":
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(
                f"transport kind 'torch' needs a process group: launch with torchrun (it sets {missing}) "
                "or set [transport] init_method"
            )
    if config.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False; use backend='gloo'")
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
        dist.init_process_group(config.backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(config.backend, init_method=config.init_method, timeout=timeout)

"""How a run's workers are laid out by its transport's spec (all of them threads of this process, or
this process one worker of many), in words, and the run's mode and quorum checked against that layout."""

from __future__ import annotations

import os

from transports import TransportSpec, transport_spec

from .run_config import RunConfig

__all__ = ["check_processes", "check_quorum", "describe_workers", "local_workers"]


def local_workers(config: RunConfig, spec: TransportSpec) -> int:
    """Workers in this process: the run's, where they are threads (one in single mode); else this one."""
    return 1 if config.train.mode == "single" or not spec.threads else config.train.workers


def describe_workers(config: RunConfig) -> str:
    """How the run's workers are laid out, in words (for the CLI's first line)."""
    spec = transport_spec(config.transport)
    shards = config.train.fsdp_shards
    return spec.describe(local_workers(config, spec)) + (
        f", in islands of {shards} FSDP ranks" if shards > 1 else ""
    )


def check_processes(config: RunConfig, spec: TransportSpec) -> None:
    """The run's mode and quorum against how this transport lays out its workers and who started the process."""
    if config.train.mode == "single" and not spec.threads:
        raise ValueError(
            f"train.mode='single' runs one worker in one process; [transport] kind={spec.kind!r} needs ddp or diloco"
        )
    world_env = os.environ.get("WORLD_SIZE", "1")
    if spec.threads and world_env.isdigit() and int(world_env) > 1:  # torchrun started this process
        raise ValueError(
            f"[transport] kind={spec.kind!r} runs all the run's workers in each process, but torchrun started "
            f"WORLD_SIZE={world_env} processes: add --set transport.kind=torch (docs/lan.md)"
        )
    check_quorum(config, spec)


def check_quorum(config: RunConfig, spec: TransportSpec) -> None:
    """A quorum the run's workers cannot reach, where their count is known (they are this process's
    threads), is an error, not a round that waits for every worker."""
    quorum, workers = spec.section.get("quorum", 0), config.train.workers
    if spec.threads and config.train.mode != "single" and quorum > workers:
        raise ValueError(
            f"transport.quorum={quorum} is invalid with train.workers={workers}: "
            f"expected an integer in [0, {workers}] (0: every worker)"
        )

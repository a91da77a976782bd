"""Which data each worker trains on: its rank's shard, or the one ``train.shard`` names where ranks come and go."""

from __future__ import annotations

from transports import TransportSpec

from ..run_config import RunConfig
from ..train_config import TrainConfig
from .corpus import BatchSampler, Corpus

__all__ = ["check_data", "check_shards", "shard_of"]


def shard_of(t: TrainConfig, *, rank: int, world_size: int) -> tuple[int, int]:
    """(shard, number of shards) of a worker: its rank, unless train.shard names one."""
    if t.shard >= 0:
        return t.shard, t.num_shards
    return rank, t.num_shards or world_size


def check_shards(t: TrainConfig, spec: TransportSpec) -> None:
    """train.shard is for one-worker-per-process transports, and needed where their ranks come and go."""
    if not spec.fixed_ranks and t.mode != "single" and (t.shard < 0 or t.num_shards < 1):
        raise ValueError(
            f"{spec.kind} peers have no fixed ranks: give each peer its own data shard with "
            "train.shard=K and train.num_shards=N (0 <= K < N), or all peers train on the same data"
        )
    if spec.threads and (t.shard >= 0 or t.num_shards):
        raise ValueError(
            "train.shard and train.num_shards are for one-worker-per-process transports; in-process "
            "workers take their rank's shard"
        )


def check_data(config: RunConfig, corpus: Corpus, world_size: int) -> None:
    """Fail before any worker starts when a shard or the validation set is too small for a batch."""
    t, seq = config.train, config.data.seq_len
    BatchSampler(
        corpus.val, seq_len=seq, batch_size=t.batch_size, seed=0, what="the validation data"
    )
    for rank in range(world_size):
        shard, n = shard_of(t, rank=rank, world_size=world_size)
        if shard >= n:
            raise ValueError(
                f"train.num_shards={n} is too small for worker {rank}: shard {shard} does not exist"
            )
        what = f"shard {shard} of {n} of the training data"
        BatchSampler(
            corpus.shard(shard, n), seq_len=seq, batch_size=t.batch_size, seed=0, what=what
        )

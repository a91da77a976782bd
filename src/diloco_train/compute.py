"""What a worker computes: its device, the loss (under bf16 autocast on CUDA), the validation loss."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from .data.corpus import BatchSampler
from .model import Llama
from .run_config import RunConfig
from .train_config import TrainConfig

__all__ = ["autocast", "device_for", "evaluate", "loss_of"]

_EVAL_SEED = 1234


def device_for(t: TrainConfig, rank: int) -> torch.device:
    """The device of worker ``rank``: in-process workers on cuda spread over the visible GPUs."""
    if t.device == "cpu" or (t.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"train.device={t.device!r} but torch sees no CUDA device")
    if t.device.startswith("cuda:"):
        return torch.device(t.device)
    return torch.device("cuda", rank % torch.cuda.device_count())


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda" and bf16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_of(model: Llama, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on inputs ``x`` and targets ``y``."""
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def evaluate(model: Llama, val: torch.Tensor, config: RunConfig, device: torch.device) -> float:
    """Mean loss over ``eval_batches`` validation batches, the same windows at every call."""
    t = config.train
    sampler = BatchSampler(
        val,
        seq_len=config.data.seq_len,
        batch_size=t.batch_size,
        seed=_EVAL_SEED,
        what="validation data",
    )
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(t.eval_batches):
        x, y = sampler.next()
        with autocast(device, t.bf16):
            total += loss_of(model, x.to(device), y.to(device)).item()
    model.train(was_training)
    return total / t.eval_batches

"""The learning-rate schedule: linear warmup, then cosine decay."""

from __future__ import annotations

import math

import torch

from .train_config import TrainConfig

__all__ = ["lr_at", "set_lr"]


def lr_at(step: int, c: TrainConfig) -> float:
    """Learning rate for the 0-based ``step``: linear warmup, then cosine down to ``lr * min_lr_ratio``."""
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps - 1))
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Each group's learning rate: ``lr``, times the group's ``lr_scale`` where it has one (Muon's matrices:
    ``train.muon_lr / train.lr``, so that one schedule drives both optimizers)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)

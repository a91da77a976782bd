"""The trainer's entry point, ``train``, and what a caller uses with it.

The trainer is split by concept: ``launch`` (train(): threads or one worker per process, as the
transport's spec says), ``worker`` (the loop), ``modes`` (single, ddp, diloco and the warm start),
``resume`` (run folder and checkpoints), ``resume_from`` (the step a resume starts from), ``checkpoint``
(files), ``divergence`` (non-finite losses and states), ``metrics`` (metrics.jsonl, written and read), ``shards``,
``compute`` (loss and evaluation) and ``schedule`` (learning rate).
"""

from .compute import evaluate
from .launch import train
from .report.metrics import TrainResult
from .schedule import lr_at

__all__ = ["TrainResult", "evaluate", "lr_at", "train"]

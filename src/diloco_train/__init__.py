"""diloco_train: the application on top of diloco_core: a Llama-style model, data, training loop and CLI.

Imports point one way: diloco_train -> transports -> diloco_core; the core never imports this package.
"""

from .data.corpus import BatchSampler, Corpus, DataConfig, load_corpus
from .model import PRESETS, Llama, ModelConfig, count_parameters
from .run_config import RunConfig, build_config
from .train import TrainResult, evaluate, lr_at, train
from .train_config import TrainConfig

__all__ = [
    "PRESETS",
    "BatchSampler",
    "Corpus",
    "DataConfig",
    "Llama",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "TrainResult",
    "build_config",
    "count_parameters",
    "evaluate",
    "load_corpus",
    "lr_at",
    "train",
]

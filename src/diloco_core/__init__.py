"""diloco_core: the DiLoCo algorithm, its config and the Transport contract (torch + stdlib only)."""

from .codecs.base import BF16, FP16, FP32, CastCodec, Codec
from .codecs.block import INT4, INT8, BlockCodec
from .codecs.names import CODECS, INT2, SIGN, codec_for
from .codecs.sparse import TopKCodec
from .codecs.wire import reference_mean
from .config import DiLoCoConfig
from .diloco import DiLoCo
from .guard import ContributionGuard
from .membership import Membership
from .merge import MEAN, LeftOut, Merge, MergeRule
from .optimizer import DiLoCoOptimizer
from .report import PendingRound, RoundReport
from .run_state import RunState
from .transport import Capabilities, FutureHandle, ReduceHandle, ReduceResult, StateReplaced, Transport, TransportError

__all__ = [
    "BF16",
    "CODECS",
    "FP16",
    "FP32",
    "INT2",
    "INT4",
    "INT8",
    "MEAN",
    "SIGN",
    "BlockCodec",
    "Capabilities",
    "CastCodec",
    "Codec",
    "ContributionGuard",
    "DiLoCo",
    "DiLoCoConfig",
    "DiLoCoOptimizer",
    "FutureHandle",
    "LeftOut",
    "Membership",
    "Merge",
    "MergeRule",
    "PendingRound",
    "ReduceHandle",
    "ReduceResult",
    "RoundReport",
    "RunState",
    "StateReplaced",
    "TopKCodec",
    "Transport",
    "TransportError",
    "codec_for",
    "reference_mean",
]

"""diloco_core: the DiLoCo algorithm, its config and the Transport contract (torch + stdlib only)."""

from .config import DiLoCoConfig
from .diloco import DiLoCo, RoundReport
from .transport import FutureHandle, ReduceHandle, ReduceResult, StateReplaced, Transport, TransportError
from .wire import WIRE_DTYPES, reference_mean

__all__ = [
    "DiLoCo",
    "DiLoCoConfig",
    "FutureHandle",
    "ReduceHandle",
    "ReduceResult",
    "RoundReport",
    "StateReplaced",
    "Transport",
    "TransportError",
    "WIRE_DTYPES",
    "reference_mean",
]

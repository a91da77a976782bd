"""LAN transport over torch.distributed (gloo for CPU tensors, NCCL for CUDA tensors).

One concept per module: ``transport`` (TorchDistTransport: the buckets, the codec paths), ``group``
(TorchDistConfig, joining the process group), ``handle`` (a reduce: header, buckets, result in place),
``identity`` (the identity header; a broken group), ``membership`` (every rank proves the run's secret
before the first collective), ``worker`` (the communication thread, jobs in order).

Every module here imports the real ``torch`` (absolute imports; this package is ``transports.torch``).
"""

from .group import TorchDistConfig
from .torch_transport import TorchDistTransport

__all__ = ["TorchDistConfig", "TorchDistTransport"]

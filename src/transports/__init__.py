"""Pluggable transports for diloco_core: in-process (threads), torch.distributed (LAN), hivemind (WAN).

``transports.islands`` puts the torch.distributed one between FSDP2 islands of a DeviceMesh.

``TorchDistTransport`` and ``HivemindTransport`` are imported on first use, so that neither
torch.distributed's nor hivemind's import cost (or absence) touches the other transports.
"""

from typing import Any

from .factory import (
    DEFAULT_KIND,
    TRANSPORT_KINDS,
    TransportSpec,
    create_transport,
    diagnose,
    transport_spec,
)
from .forwarding import ForwardingTransport
from .inprocess import InProcessConfig, InProcessGroup, InProcessTransport

__all__ = [
    "DEFAULT_KIND",
    "TRANSPORT_KINDS",
    "ForwardingTransport",
    "HivemindConfig",
    "HivemindTransport",
    "InProcessConfig",
    "InProcessGroup",
    "InProcessTransport",
    "TorchDistConfig",
    "TorchDistTransport",
    "TransportSpec",
    "create_transport",
    "diagnose",
    "transport_spec",
]

_LAZY = {
    "TorchDistConfig": "torch",
    "TorchDistTransport": "torch",
    "HivemindConfig": "hivemind",
    "HivemindTransport": "hivemind",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

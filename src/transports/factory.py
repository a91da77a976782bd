"""Build a transport from a config section such as a TOML ``[transport]`` table."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from diloco_core.config import from_mapping
from diloco_core.transport import Transport

from .inprocess import InProcessConfig, InProcessTransport

__all__ = ["create_transport", "TRANSPORT_KINDS"]


def _inprocess(section: Mapping[str, Any]) -> Transport:
    return InProcessTransport.from_config(from_mapping(InProcessConfig, section, "transport"))


def _torch(section: Mapping[str, Any]) -> Transport:
    from .torch_dist import TorchDistConfig, TorchDistTransport

    return TorchDistTransport.from_config(from_mapping(TorchDistConfig, section, "transport"))


def _hivemind(section: Mapping[str, Any]) -> Transport:
    from .hivemind import HivemindConfig, HivemindTransport

    return HivemindTransport(from_mapping(HivemindConfig, section, "transport"))


TRANSPORT_KINDS: dict[str, Callable[[Mapping[str, Any]], Transport]] = {
    "inprocess": _inprocess,
    "torch": _torch,
    "hivemind": _hivemind,
}


_DERIVED_TIMEOUT = {"torch": "timeout"}
"""Per kind, the config field that defaults to the core's reduce timeout when the section leaves it unset."""


def create_transport(section: Mapping[str, Any], *, reduce_timeout: float | None = None) -> Transport:
    """``section["kind"]`` picks the transport; the other keys are that transport's config fields.
    ``reduce_timeout`` (the core's, ``[diloco] reduce_timeout``) is the default of the transport's own
    collective timeout, so that one setting bounds a round unless the section says otherwise."""
    section = dict(section)
    kind = section.pop("kind", "inprocess")
    if reduce_timeout is not None and kind in _DERIVED_TIMEOUT:
        section.setdefault(_DERIVED_TIMEOUT[kind], reduce_timeout)
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"[transport] kind={kind!r} is invalid: expected one of {sorted(TRANSPORT_KINDS)}")
    return TRANSPORT_KINDS[kind](section)

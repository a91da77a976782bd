"""Build a transport from a config section such as a TOML ``[transport]`` table, and say how its workers launch.

This is the one module that knows the transport kinds. A launcher (the trainer) asks ``transport_spec``
how a section's workers start, and connects them with ``TransportSpec.connect``; it never names a kind.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_core.rules import from_mapping
from diloco_core.transport import Transport

from .inprocess import InProcessConfig, InProcessGroup, InProcessTransport
from .quorum import QUORUM_KEYS, quorum_from
from .simulated_link import LINK_KEYS, LinkConfig, SimulatedLink, link_from_section

__all__ = [
    "DEFAULT_KIND",
    "TRANSPORT_KINDS",
    "TransportSpec",
    "create_transport",
    "diagnose",
    "transport_spec",
]

DEFAULT_KIND = "inprocess"
"""The kind of a section that names none."""


@dataclass(frozen=True, kw_only=True)
class _Kind:
    """Everything the factory knows about one transport kind, in one place."""

    create: Callable[[Mapping[str, Any]], Transport]
    """Builds the transport from its section (no ``kind``, no link keys)."""
    spec: Callable[..., TransportSpec]
    """How its workers launch: ``spec(kind=, section=, own=, link=)`` (``own``: the section's keys but the
    link's) to a ``TransportSpec``."""
    derived_timeout: str | None = None
    """The config field that defaults to the core's reduce timeout when the section leaves it unset."""
    diagnose: Callable[[Mapping[str, Any]], list] | None = None
    """``diloco doctor``: checks of the section's network before a run, each with ``.ok`` and ``.line``."""


def _inprocess(section: Mapping[str, Any]) -> Transport:
    return InProcessTransport.from_config(from_mapping(InProcessConfig, section, "transport"))


def _inprocess_spec(
    *, kind: str, section: dict[str, Any], own: Mapping[str, Any], link: LinkConfig | None
) -> TransportSpec:
    extra = sorted(set(own) - {"kind", *QUORUM_KEYS})
    if extra:
        raise ValueError(
            f"unknown key(s) {extra} in [transport] for kind 'inprocess'; valid keys: "
            f"{['kind', *QUORUM_KEYS, *sorted(LINK_KEYS)]} (the trainer sets world size and ranks from train.workers)"
        )
    quorum_from(own)  # checked now: a bad value is the launch's error
    return TransportSpec(kind=kind, section=section, threads=True, fixed_ranks=True, link=link)


def _torch(section: Mapping[str, Any]) -> Transport:
    from .torch import TorchDistConfig, TorchDistTransport

    return TorchDistTransport.from_config(from_mapping(TorchDistConfig, section, "transport"))


def _torch_spec(
    *, kind: str, section: dict[str, Any], own: Mapping[str, Any], link: LinkConfig | None
) -> TransportSpec:
    return TransportSpec(
        kind=kind,
        section=section,
        threads=False,
        fixed_ranks=True,
        processes_on_machine=_local_world_size(),
        secret_keys=frozenset({"secret"}),
        fsdp_islands=True,
        link=link,
    )


def _hivemind(section: Mapping[str, Any]) -> Transport:
    from .hivemind import HivemindConfig, HivemindTransport

    return HivemindTransport(from_mapping(HivemindConfig, section, "transport"))


def _hivemind_diagnose(section: Mapping[str, Any]) -> list:
    from .hivemind import HivemindConfig
    from .hivemind.doctor import diagnose

    return diagnose(from_mapping(HivemindConfig, section, "transport"))


def _hivemind_spec(
    *, kind: str, section: dict[str, Any], own: Mapping[str, Any], link: LinkConfig | None
) -> TransportSpec:
    # a missing hivemind says so before a run starts
    importlib.import_module(".hivemind", __package__)
    return TransportSpec(
        kind=kind,
        section=section,
        threads=False,
        fixed_ranks=False,
        processes_on_machine=_local_world_size(),
        secret_keys=frozenset({"secret"}),
        join_key="initial_peers",
        link=link,
    )


TRANSPORT_KINDS: dict[str, _Kind] = {
    "inprocess": _Kind(create=_inprocess, spec=_inprocess_spec),
    "torch": _Kind(create=_torch, spec=_torch_spec, derived_timeout="timeout"),
    "hivemind": _Kind(create=_hivemind, spec=_hivemind_spec, diagnose=_hivemind_diagnose),
}
"""One entry per transport kind: how to build it, how its workers launch, which timeout it derives."""


def _kind_of(section: Mapping[str, Any]) -> str:
    kind = section.get("kind", DEFAULT_KIND)
    if kind not in TRANSPORT_KINDS:
        raise ValueError(
            f"[transport] kind={kind!r} is invalid: expected one of {sorted(TRANSPORT_KINDS)}"
        )
    return kind


def diagnose(section: Mapping[str, Any]) -> list | None:
    """``diloco doctor``'s findings for a ``[transport]`` section (None: its kind has nothing to check)."""
    kind = _kind_of(section)
    _, section = link_from_section(section)  # a simulated link has no network to check
    section.pop("kind", None)
    check = TRANSPORT_KINDS[kind].diagnose
    return None if check is None else check(section)


def _behind(link: LinkConfig | None, transport: Transport) -> Transport:
    return transport if link is None else SimulatedLink.from_config(transport, link)


def create_transport(
    section: Mapping[str, Any], *, reduce_timeout: float | None = None
) -> Transport:
    """``section["kind"]`` picks the transport; the other keys are that transport's config fields, but
    ``link_mbit`` and ``link_latency_ms``, which any kind takes: they put it behind a simulated link
    (``transports.simulated_link``). ``reduce_timeout`` (the core's, ``[diloco] reduce_timeout``) is the
    default of the transport's own collective timeout, so that one setting bounds a round unless the
    section says otherwise."""
    kind = _kind_of(section)
    link, section = link_from_section(section)
    section.pop("kind", None)
    entry = TRANSPORT_KINDS[kind]
    if reduce_timeout is not None and entry.derived_timeout is not None:
        section.setdefault(entry.derived_timeout, reduce_timeout)
    return _behind(link, entry.create(section))


@dataclass(frozen=True, kw_only=True)
class TransportSpec:
    """How the workers of a ``[transport]`` section are launched: what a launcher needs besides the transport."""

    kind: str
    """The section's kind, for messages."""
    section: Mapping[str, Any] = field(repr=False)
    """The section, its kind filled in (not shown: it may hold a secret)."""
    threads: bool
    """True: the run's workers are threads of one process, and ``connect(n)`` makes all n of them (so every
    worker's checkpoint is on this machine). False: each process is one worker (torch: started by torchrun;
    hivemind: a peer started by hand), and ``connect`` joins it to the others."""
    fixed_ranks: bool
    """As the transport's ``fixed_ranks``, known before connecting: ranks hold for the whole run, so a
    worker's data shard can be its rank's. False: each process must be given its own shard."""
    processes_on_machine: int = 1
    """Worker processes sharing this machine's cores (torchrun's LOCAL_WORLD_SIZE); a process's threads
    count apart."""
    secret_keys: frozenset[str] = frozenset()
    """Keys of the section that must never be written to disk."""
    join_key: str | None = None
    """The key of the section that takes another peer's ``Transport.join_addresses``; None where peers
    are not joined by address."""
    fsdp_islands: bool = False
    """``connect_islands`` can put this process's worker between FSDP2 islands (torch.distributed)."""
    link: LinkConfig | None = None
    """The simulated link every transport ``connect`` makes sits behind (``link_mbit``); None: none."""

    def describe(self, workers: int) -> str:
        """How a run's workers are laid out, in words; ``workers`` counts this process's threads."""
        if self.threads:
            return f"{workers} in-process worker(s)"
        return f"one worker per process on {self.kind}"

    def connect(
        self,
        workers: int,
        *,
        reduce_timeout: float | None = None,
        create: Callable[..., Transport] | None = None,
    ) -> list[Transport]:
        """The transports of this process's workers: ``workers`` members of a new group where workers are
        threads, else this process's one member of the run's group (``reduce_timeout``: as in
        ``create_transport``; ``create``: made by it, which takes ``create_transport``'s
        arguments, in its place: a test seam)."""
        if self.threads:
            if create is not None:
                raise ValueError(
                    f"{self.kind}'s workers are threads: no transport of its own to create"
                )
            group = InProcessGroup(workers, quorum=quorum_from(self.section))
            return [_behind(self.link, group.transport(rank)) for rank in range(workers)]
        return [(create or create_transport)(self.section, reduce_timeout=reduce_timeout)]

    def connect_islands(
        self, model: Any, mesh: Any, *, reduce_timeout: float | None = None
    ) -> Transport:
        """The transport between FSDP2 islands for ``model``, sharded over ``mesh["shard"]`` (a 2-D DeviceMesh,
        ``transports.islands``), once ``connect`` has joined the process group."""
        if not self.fsdp_islands:
            raise ValueError(
                f"[transport] kind={self.kind!r} cannot connect FSDP islands; use kind='torch'"
            )
        from .islands import island_transport
        from .torch.group import TorchDistConfig

        section = {k: v for k, v in self.section.items() if k != "kind" and k not in LINK_KEYS}
        if reduce_timeout is not None:
            section.setdefault("timeout", reduce_timeout)
        config = from_mapping(TorchDistConfig, section, "transport")
        return island_transport(
            model, mesh, bucket_mb=config.bucket_mb, timeout=config.timeout, narrow=config.narrow
        )


def _local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def transport_spec(section: Mapping[str, Any]) -> TransportSpec:
    """How ``section``'s workers launch; ValueError for an unknown kind, or keys a launch cannot take.
    A simulated link's keys stay in the spec's ``section`` and are read into its ``link``."""
    kind = _kind_of(section)
    link, own = link_from_section(section)
    section = {**section, "kind": kind}
    return TRANSPORT_KINDS[kind].spec(kind=kind, section=section, own=own, link=link)

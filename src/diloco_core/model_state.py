"""The model's state besides its trainable parameters: frozen parameters and buffers, matched by name.

The outer step averages the trainable parameters; ``ModelState`` keeps the rest of ``model.state_dict()``
the same on every rank. At construction (collectively) it checks that every rank's model has rank 0's
entries, in order: names, kinds (trainable, frozen, buffer), shapes and dtypes; then rank 0's frozen
parameters and persistent buffers are broadcast with the global params. Every round the floating-point
persistent buffers (BatchNorm's running mean and variance) are averaged in fp32 by a reduce of their own
(key ``diloco/buffers``), whatever codec the pseudo-gradient travels in, and never through the outer step
or error feedback. Integer buffers (BatchNorm's ``num_batches_tracked``) keep each rank's own value: they
count the same steps everywhere. Non-persistent buffers (rotary caches, masks) are derived from the rest
and left alone. The frozen parameters and persistent buffers are in ``DiLoCo.state_dict()``, by name.
A DTensor (FSDP2) counts as its local shard, its entry naming which shard it is (``flat.placement_of``).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import torch

from .agreement import differs_anywhere, rank0s
from .codecs.base import FP32
from .flat import FlatBuffer, local_of, placement_of
from .transport import ReduceHandle, ReduceResult, Transport, TransportError

__all__ = ["ModelState"]

BUFFERS_KEY = "diloco/buffers"


def _describe(entry: list | None) -> str:
    if entry is None:
        return "nothing (fewer entries)"
    name, kind, shape, dtype = entry
    return f"{name!r} ({kind}, shape {tuple(shape)}, {dtype})"


def _counts(spec: list) -> str:
    shapes = [shape for _, kind, shape, _ in spec if kind == "trainable"]
    return f"{len(shapes)} tensors with {sum(torch.Size(s).numel() for s in shapes)} values"


class ModelState:
    """A model's entries by name: its trainable parameters (``names``, in ``DiLoCo.params``' order) and the
    rest of its ``state_dict()`` (``extra``: frozen parameters and persistent buffers)."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor], device: torch.device | str) -> None:
        self._named = list(model.named_parameters())
        self._device = torch.device(device)  # where the check's tensors travel (NCCL moves CUDA tensors only)
        self._was_trainable = [p.requires_grad for _, p in self._named]
        self.names = [name for name, p in self._named if p.requires_grad]
        trainable, buffers = {id(p) for p in params}, {id(b) for b in model.buffers()}
        self.extra: dict[str, torch.Tensor] = {}
        """By name, this rank's local tensor (``local_of``) of each frozen parameter and persistent buffer."""
        self._spec: list[list] = []
        self.averaged: list[torch.Tensor] = []
        """The floating-point persistent buffers, averaged every round."""
        seen: set[int] = set()
        for name, t in model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue  # tied tensors once; get_extra_state's objects are the model's own business
            seen.add(id(t))
            kind = "trainable" if id(t) in trainable else "buffer" if id(t) in buffers else "frozen"
            local = local_of(t)
            self._spec.append([name, kind, list(local.shape), str(t.dtype) + placement_of(t)])
            if kind != "trainable":
                self.extra[name] = local
            if kind == "buffer" and local.is_floating_point():
                self.averaged.append(local)
        self._flat = FlatBuffer(self.averaged, device) if self.averaged else None
        exact = [t for t in self.extra.values() if not any(t is a for a in self.averaged)]
        here = [t.device == torch.device(device) and t.is_contiguous() for t in exact]  # broadcast in place
        self._exact = [(t, t.detach() if ok else t.detach().to(device, copy=True)) for t, ok in zip(exact, here)]

    def broadcast(self, transport: Transport, global_flat: torch.Tensor, *, timeout: float) -> None:
        """The construction's broadcast from rank 0 (collective): ``global_flat``, the averaged buffers' fp32 copy
        (which a transport serving joiners keeps serving as it changes), then the rest exactly."""
        shared = [copy for _, copy in self._exact]
        if self._flat is not None:
            self._flat.copy_from(self.averaged)
            shared.insert(0, self._flat.flat)
        transport.broadcast([global_flat, *shared], src=0, timeout=timeout)
        if self._flat is not None:
            self._flat.copy_to(self.averaged)
        for t, copy in self._exact:
            if copy.data_ptr() != t.data_ptr():
                t.copy_(copy)

    def check_same(self, transport: Transport, timeout: float) -> None:
        """Refuse, on every rank, a group whose models differ from rank 0's in an entry (collective)."""
        rank0, spec = rank0s(transport, self._spec, timeout=timeout, device=self._device), self._spec
        spec = json.loads(json.dumps(spec))  # as rank 0's came: tuples are lists
        first = next((i for i, (a, b) in enumerate(zip(spec, rank0)) if a != b), min(len(spec), len(rank0)))
        differs = spec != rank0
        flags = torch.zeros(len(rank0) + 2, device=self._device)  # [differs, one-hot of where it first differs]
        flags[0], flags[1 + first] = float(differs), float(differs)
        differs_anywhere(transport, flags, timeout)
        at = (flags[1:] > 0).nonzero()
        i = int(at[0]) if len(at) else len(rank0)
        where = f"rank 0's {_describe(rank0[i])}" if i < len(rank0) else "the end of rank 0's entries (a rank has more)"
        advice = "every rank must build the same model, registering its parameters and buffers in the same order"
        advice += " (FSDP2: the transport's group must be the ranks holding the same shards, transports.islands)"
        if differs:
            here = _describe(spec[first] if first < len(spec) else None)
            raise ValueError(
                f"rank {transport.rank}'s model differs from rank 0's at {here} here vs "
                f"{_describe(rank0[first] if first < len(rank0) else None)} on rank 0 "
                f"({_counts(spec)} here vs {_counts(rank0)} on rank 0 are trainable); {advice}"
            )
        if flags[0].item() > 0:
            raise ValueError(
                f"{flags[0].item():.0f} rank(s) have a model that differs from rank 0's, first at {where}; {advice}"
            )

    def check_trainable(self) -> None:
        """Refuse a model whose set of trainable parameters changed since construction (``ValueError``)."""
        for (name, p), was in zip(self._named, self._was_trainable):
            if p.requires_grad != was:
                now = "trainable" if p.requires_grad else "frozen"
                raise ValueError(
                    f"parameter {name!r} is {now} now but was not when DiLoCo was built: DiLoCo synchronizes "
                    "the parameters trainable at construction; build DiLoCo (with its inner optimizer) again "
                    "after changing requires_grad"
                )

    def begin(self, transport: Transport) -> ReduceHandle | None:
        """Start the round's reduce of the floating-point buffers (None: the model has none)."""
        if self._flat is None:
            return None
        self._flat.copy_from(self.averaged)
        return transport.all_reduce([self._flat.flat], codec=FP32, key=BUFFERS_KEY)

    def wait(self, main: ReduceHandle, buffers: ReduceHandle | None, timeout: float) -> ReduceResult:
        """Wait for the round's reduce, then the buffers' (even if the first failed: their tensors are
        not reused before), and put the buffers' mean in the model once both succeeded."""
        try:
            result = main.wait(timeout)
        except TransportError:
            if buffers is not None:
                with contextlib.suppress(TransportError):
                    buffers.wait(timeout)
            raise
        if buffers is not None and self._flat is not None:
            buffers.wait(timeout)
            self._flat.copy_to(self.averaged)
        return result

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach() for name, t in self.extra.items()}

    @torch.no_grad()
    def check_loadable(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` (``DiLoCo.state_dict()``) holds this model's entries."""
        names = state["param_names"]
        if list(names) != self.names:
            first = next(
                (i for i, (a, b) in enumerate(zip(names, self.names)) if a != b), min(len(names), len(self.names))
            )
            saved, here = (n[first] if first < len(n) else "nothing" for n in (names, self.names))
            raise ValueError(f"DiLoCo state's trainable parameter #{first} is {saved!r}; this model's is {here!r}")
        saved = state["model_state"]
        if set(saved) != set(self.extra):
            diff = sorted(set(saved) ^ set(self.extra))
            raise ValueError(f"DiLoCo state's model_state does not fit this model: {diff[0]!r} is in one only")
        for name, t in self.extra.items():
            if tuple(saved[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"DiLoCo state's {name!r} is {tuple(saved[name].shape)}, this model's {tuple(t.shape)}"
                )

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        """Load what ``check_loadable`` accepted."""
        for name, t in self.extra.items():
            t.copy_(state["model_state"][name])
        if self._flat is not None:
            self._flat.copy_from(self.averaged)

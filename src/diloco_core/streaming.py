"""Streaming DiLoCo's fragments (arXiv 2501.18512): which parameters each holds, and when each syncs.

The model is cut into P fragments of strided blocks: the blocks of its largest ``nn.ModuleList`` (or
``nn.Sequential``) go to fragment ``i % P``, so every fragment spans the model's depth; each parameter
outside the blocks (embeddings, final norm, head) joins the fragment holding the fewest values so far.
Fragment p begins its reduce at the inner steps ``s`` with ``s % H == ((p + 1) * H // P) % H``, so one
fragment syncs every H / P steps and the last syncs where a blocking round would; its outer step is
applied ``tau`` inner steps later. Every worker derives the same fragments and schedule (the settings
check compares P, tau and alpha).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["begins_at", "strided_fragments", "user_fragments"]


def _blocks(model: torch.nn.Module, trainable: set[int]) -> list[torch.nn.Module]:
    """The children of the model's container with the most children holding trainable parameters."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = [c for c in module.children() if any(id(p) in trainable for p in c.parameters())]
            if len(children) > len(best):
                best = children
    return best


def strided_fragments(model: torch.nn.Module, params: Sequence[torch.Tensor], num: int) -> list[list[int]]:
    """Indices into ``params`` (the trainable parameters, in model order) of each of ``num`` fragments."""
    index = {id(p): i for i, p in enumerate(params)}
    blocks = _blocks(model, set(index))
    if num > 1 and len(blocks) < num:
        raise ValueError(
            f"fragments={num} needs a model with at least {num} repeated blocks (an nn.ModuleList or nn.Sequential "
            f"of them); its largest has {len(blocks)}: use fewer fragments or give them (DiLoCo(fragments=...))"
        )
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            if id(p) in index:
                owner.setdefault(index[id(p)], i % num)
    sizes = [0] * num
    for i, f in owner.items():
        sizes[f] += params[i].numel()
    for i, p in enumerate(params):
        if i not in owner:
            owner[i] = min(range(num), key=lambda f: (sizes[f], f))
            sizes[owner[i]] += p.numel()
    return [[i for i in range(len(params)) if owner[i] == f] for f in range(num)]


def user_fragments(names: Sequence[str], fragments: Sequence[Sequence[str]], num: int) -> list[list[int]]:
    """Fragments given by the trainable parameters' names: each name in exactly one, ``num`` fragments."""
    if len(fragments) != num:
        raise ValueError(f"fragments= holds {len(fragments)} fragment(s) but the config's fragments={num}")
    where: dict[str, int] = {}
    for f, group in enumerate(fragments):
        if not group:
            raise ValueError(f"fragment {f} is empty: every fragment needs at least one trainable parameter")
        for name in group:
            if name not in names:
                raise ValueError(f"fragment {f} names {name!r}, which is not a trainable parameter of the model")
            if name in where:
                raise ValueError(f"{name!r} is in fragments {where[name]} and {f}: each parameter belongs to one")
            where[name] = f
    missing = [n for n in names if n not in where]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameter(s) are in no fragment, first {missing[0]!r}")
    return [[i for i, n in enumerate(names) if where[n] == f] for f in range(num)]


def begins_at(step: int, *, inner_steps: int, fragments: int) -> int | None:
    """The fragment whose reduce begins after inner step ``step`` (1 for the first), or None."""
    for p in range(fragments):
        if step % inner_steps == ((p + 1) * inner_steps // fragments) % inner_steps:
            return p
    return None

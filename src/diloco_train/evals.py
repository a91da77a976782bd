"""Which weights an eval sees, and when: the run's global weights, at round boundaries.

The model a run produces is DiLoCo's global copy (the shared weights after the last outer step), not a
worker's replica, which drifts from it for the ``inner_steps`` steps of a round (and, with streaming's
``merge_alpha`` or eager updates, stays apart from it by design). So an eval loads the global copy into the
model, evaluates, and puts the worker's own weights back exactly. What "global" means per mode:

- diloco, ``overlap="none"``: the global copy after the last round; at a round's end it is the model itself.
- ``overlap="streaming"``: each fragment's global copy after its last outer step (fragments end at
  different steps, so at no step are all of them one round's).
- ``overlap="eager"``: the consensus global copy, stepped with the delayed means (a worker's own outer
  parameters differ from it by its fresh share); the model becomes it at the end of training.
- ddp, single, and diloco's DDP warm start: the model's own weights (every replica holds the same).

An eval every ``train.eval_every`` steps is taken at the first round boundary at or after it (rounds at 15,
30, ...: evals asked for at 10 and 20 come at 15 and 30), so every eval but a last one that ends the run
mid-round (``train.stop_after``) sees a global copy of that very step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .modes import Sync

__all__ = ["EvalSchedule", "global_weights"]


@contextmanager
def global_weights(sync: Sync) -> Iterator[None]:
    """Within: ``sync``'s model holds the run's global weights (see above); after: its own, bit for bit.
    FSDP2 islands: each rank swaps its own shards, so island 0's ranks evaluate the global model together."""
    diloco = sync.diloco
    if diloco is None:  # ddp, single, a DDP warm start: the model's weights are the run's
        yield
        return
    local, global_params = diloco.local, diloco.global_params
    with torch.no_grad():
        # kept where the global copy lives (diloco.global_device, CPU by default): no accelerator memory
        own = [t.to(g.device, copy=True) for t, g in zip(local, global_params)]
        torch._foreach_copy_(local, global_params)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_(local, own)


class EvalSchedule:
    """When a worker evaluates: at the first round boundary at or after each multiple of ``every``, and at
    ``end`` (the last step of this invocation) whatever it is."""

    def __init__(self, *, every: int, start: int, end: int) -> None:
        self.every, self.end = every, end
        self.last = start  # the last step seen (rounds by time move the step by whole rounds)
        self.owed = False  # a multiple of ``every`` passed since the last eval

    def due(self, step: int, *, boundary: bool) -> bool:
        """Whether to evaluate after reaching ``step``; ``boundary``: the global weights changed at this step."""
        self.owed = self.owed or step // self.every > self.last // self.every
        self.last = step
        if step == self.end or (self.owed and boundary):
            self.owed = False
            return True
        return False

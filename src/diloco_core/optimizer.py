"""DiLoCo behind the ``torch.optim.Optimizer`` surface, for loops that call ``optimizer.step()`` themselves."""

from __future__ import annotations

from typing import Any

import torch

from .diloco import DiLoCo
from .report import RoundReport

__all__ = ["DiLoCoOptimizer"]


class DiLoCoOptimizer(torch.optim.Optimizer):
    """``step()`` is ``DiLoCo.step()``: the inner step, and after every ``inner_steps``-th an outer round.

    Hand it wherever an optimizer goes (HF ``Trainer(optimizers=...)``, ``accelerator.prepare``, Lightning's
    ``configure_optimizers``, a torch LR scheduler). ``param_groups``, ``state`` and ``defaults`` are the inner
    optimizer's own objects, so a scheduler's learning rate reaches it; ``zero_grad`` zeroes its gradients;
    ``state_dict`` is ``DiLoCo.state_dict()`` (model, global copy, both optimizers, counters) and
    ``load_state_dict`` restores it all. A ``closure`` is called once, before the inner step.
    """

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco
        self.last_report: RoundReport | None = None
        """The latest outer round's report (None before the first)."""
        inner = diloco.inner_optimizer
        super().__init__(inner.param_groups, inner.defaults)  # torch's step hooks; its groups are replaced next
        self._share()

    def _share(self) -> None:
        inner = self.diloco.inner_optimizer  # its load_state_dict replaces its groups and state: share them again
        self.param_groups, self.state, self.defaults = inner.param_groups, inner.state, inner.defaults

    def step(self, closure: Any = None) -> Any:
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        report = self.diloco.step()
        if report is not None:
            self.last_report = report
        return loss

    def flush(self) -> None:
        """``DiLoCo.flush()``: after the last step, apply the outer rounds still in flight (overlap modes)."""
        self.diloco.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.diloco.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.diloco.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.diloco.load_state_dict(state_dict)
        self._share()

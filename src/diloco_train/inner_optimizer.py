"""The inner optimizer a worker steps every step (``train.inner_optimizer``): AdamW, or Muon for the hidden
matrices with AdamW for the rest, presented to the trainer and to DiLoCo as one ``torch.optim.Optimizer``."""

from __future__ import annotations

from typing import Any

import torch

from .model import Llama
from .train_config import TrainConfig

__all__ = ["MuonAdamW", "build_inner_optimizer"]


def build_inner_optimizer(model: Llama, t: TrainConfig) -> torch.optim.Optimizer:
    """``t.inner_optimizer``'s optimizer over ``model``. Matrices decay by ``t.weight_decay``, norms do not.
    adamw: torch's AdamW, as it always was; muon: ``MuonAdamW``, the decoder blocks' 2-D weights to Muon.

    Muon's group has ``lr_scale`` = muon_lr / lr: the schedule (``schedule.set_lr``) gives it ``t.muon_lr`` at
    the peak. Muon decays by its own lr times its weight decay, set so that the product is AdamW's."""
    hidden = (
        [p for p in model.blocks.parameters() if p.ndim == 2] if t.inner_optimizer == "muon" else []
    )
    taken = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in taken]
    decay = [p for p in rest if p.ndim >= 2]
    no_decay = [p for p in rest if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))
    if not hidden:
        return adamw
    scale = t.muon_lr / t.lr
    muon = torch.optim.Muon(
        [{"params": hidden, "lr_scale": scale}], lr=t.muon_lr, weight_decay=t.weight_decay / scale
    )
    return MuonAdamW(muon, adamw)


class MuonAdamW(torch.optim.Optimizer):
    """torch's ``Muon`` and ``AdamW`` stepped together, as one optimizer.

    ``param_groups`` is Muon's groups then AdamW's (the same dicts: ``schedule.set_lr`` reaches both), ``state`` one
    dict that both optimizers hold (``state.clear()`` restarts both); ``state_dict`` is torch's format over
    those groups, so a checkpoint resumes exactly.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw
        super().__init__([*muon.param_groups, *adamw.param_groups], {"lr": muon.defaults["lr"]})
        self._share()

    def _share(self) -> None:
        """Hand each optimizer its groups and the one state (torch's load_state_dict replaces both objects)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = (
            self.param_groups[:n],
            self.param_groups[n:],
        )
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()

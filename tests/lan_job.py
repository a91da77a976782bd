"""A small DiLoCo job, run by test_torch_dist under torchrun and in-process threads alike.

Under torchrun each rank saves its global params and outer momentum to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys

import torch

from diloco_core import DiLoCo, DiLoCoConfig, Transport
from transports import create_transport

ROUNDS, H = 3, 4


def job(transport: Transport, wire_dtype: str) -> list[torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    init = torch.Generator().manual_seed(transport.rank)  # replicas start different; DiLoCo syncs them to rank 0
    for p in model.parameters():  # a generator of its own: ranks may be threads sharing torch's global one
        p.data = torch.randn(p.shape, generator=init) * 0.3
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dl = DiLoCo(model, opt, transport, DiLoCoConfig(inner_steps=H, codec=wire_dtype, reduce_timeout=60))
    for step in range(ROUNDS * H):
        g = torch.Generator().manual_seed(1000 * transport.rank + step)
        x = torch.randn(32, 10, generator=g)
        torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()
        dl.step()
        opt.zero_grad()
    assert dl.round == ROUNDS
    return [t.clone() for t in dl.global_params] + [s["momentum_buffer"] for s in dl.outer_optimizer.state.values()]


if __name__ == "__main__":
    torch.set_num_threads(1)
    with create_transport({"kind": "torch", "backend": "gloo", "timeout": 60}) as t:
        torch.save(job(t, sys.argv[1]), os.path.join(sys.argv[2], f"rank{t.rank}.pt"))

"""DiLoCo in PyTorch Lightning: 2 workers (threads) averaging every 10 steps.

Run: python examples/lightning_module.py. configure_optimizers returns a DiLoCoOptimizer (and a
scheduler); Lightning's automatic optimization calls its step(closure). Workers in processes of their
own (other machines): see docs/integrations.md ("One worker per process").
"""

import hashlib
import pathlib
import sys
import threading

import lightning as L
import torch

from diloco_core import DiLoCo, DiLoCoConfig, DiLoCoOptimizer
from transports import create_transport

WORKERS, INNER_STEPS, STEPS, SEQ = 2, 10, 40, 32
TEXT = torch.tensor(list(pathlib.Path(threading.__file__).read_bytes()))  # bytes of a stdlib module: no download


class ByteLM(L.LightningModule):
    def __init__(self, transport) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.GELU(), torch.nn.Linear(64, 256))
        self.transport, self.losses = transport, []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(self.net(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        inner = torch.optim.AdamW(self.parameters(), lr=1e-2)
        optimizer = DiLoCoOptimizer(DiLoCo(self, inner, self.transport, DiLoCoConfig(inner_steps=INNER_STEPS)))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def worker(rank: int, out: dict) -> None:
    windows = torch.stack([TEXT[s : s + SEQ + 1] for s in range(rank * 8000, rank * 8000 + 8000, 25)])
    loader = torch.utils.data.DataLoader(windows, batch_size=8, shuffle=True)  # each worker its own slice
    spec = {"kind": "inprocess", "world_size": WORKERS, "rank": rank, "group": "pl"}
    with create_transport(spec) as transport:
        module = ByteLM(transport)
        trainer = L.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader)
    out[rank] = module.losses, trainer.optimizers[0].diloco


if __name__ == "__main__":
    out: dict = {}
    threads = [threading.Thread(target=worker, args=(rank, out)) for rank in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(out) < WORKERS:  # a worker's thread raised: its traceback is above
        sys.exit(f"{WORKERS - len(out)} of {WORKERS} workers failed")
    for rank, (losses, diloco) in sorted(out.items()):
        digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in diloco.global_params)).hexdigest()[:16]
        print(f"worker {rank}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {diloco.round} rounds, global params {digest}")

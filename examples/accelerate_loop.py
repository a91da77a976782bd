"""DiLoCo in an Accelerate training loop: 2 workers (threads) averaging every 10 steps.

Run: python examples/accelerate_loop.py. The loop is Accelerate's usual one; only the optimizer handed
to accelerator.prepare changes. Workers in processes of their own (other machines): see
docs/integrations.md ("One worker per process").
"""

import hashlib
import pathlib
import sys
import threading

import torch
from accelerate import Accelerator

from diloco_core import DiLoCo, DiLoCoConfig, DiLoCoOptimizer
from transports import create_transport

WORKERS, INNER_STEPS, STEPS, SEQ = 2, 10, 40, 32
TEXT = torch.tensor(list(pathlib.Path(threading.__file__).read_bytes()))  # bytes of a stdlib module: no download


def batches(rank: int) -> torch.utils.data.DataLoader:  # each worker its own slice of the text
    windows = torch.stack([TEXT[s : s + SEQ + 1] for s in range(rank * 8000, rank * 8000 + 8000, 25)])
    return torch.utils.data.DataLoader(windows, batch_size=8, shuffle=True)


def worker(rank: int, out: dict) -> None:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.GELU(), torch.nn.Linear(64, 256))
    spec = {"kind": "inprocess", "world_size": WORKERS, "rank": rank, "group": "acc"}
    with create_transport(spec) as transport:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer = DiLoCoOptimizer(DiLoCo(model, inner, transport, DiLoCoConfig(inner_steps=INNER_STEPS)))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, batches(rank), scheduler)
        losses = []
        for step, batch in zip(range(STEPS), loader):
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    out[rank] = losses, optimizer.optimizer.diloco  # accelerate wraps the optimizer


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

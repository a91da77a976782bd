"""NCCL check for a machine with 2+ GPUs: the contract and a timing of the 25M-value reduce.

    torchrun --standalone --nproc-per-node=2 bench/nccl_check.py

Prints "nccl check passed" on rank 0 when every wire dtype gives the reference mean on every rank.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from diloco_core import DiLoCo, DiLoCoConfig, codec_for, reference_mean
from transports import create_transport


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    transport = create_transport({"kind": "torch", "backend": "nccl", "timeout": 120})
    rank, world = transport.rank, transport.world_size
    dev = torch.device("cuda")

    def contribution(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(r)
        return [torch.randn(1001, generator=g).to(dev), torch.randn(7, 3, generator=g).to(dev)]

    for wire in ("fp32", "fp16", "bf16", "int8", "int4", "sign"):
        x = contribution(rank)
        result = transport.all_reduce(x, codec=codec_for(wire)).wait(60)
        assert result.num_contributors == world
        for i, got in enumerate(x):
            want = reference_mean([contribution(r)[i] for r in range(world)], wire)
            if wire == "fp32":
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(got, want), (wire, i)

    model = torch.nn.Linear(64, 64).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = DiLoCoConfig(inner_steps=2, global_device="cuda", codec="int8", error_feedback=True)
    dl = DiLoCo(model, opt, transport, config)
    for _ in range(4):
        model(torch.randn(8, 64, device=dev)).square().mean().backward()
        dl.step()
        opt.zero_grad()
    gathered = [torch.empty_like(dl.global_params[0]) for _ in range(world)]
    dist.all_gather(gathered, dl.global_params[0])
    assert all(torch.equal(gathered[0], g) for g in gathered)

    big = torch.randn(25_000_000, device=dev)
    for wire in ("raw", "fp32", "fp16", "bf16", "int8", "int4", "sign"):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            if wire == "raw":
                dist.all_reduce(big)
                big.div_(world)  # the mean, as the transport's: a bare sum grows big toward inf
            else:
                transport.all_reduce([big], codec=codec_for(wire)).wait(60)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"nccl 25M {wire}: {sorted(times)[len(times) // 2] * 1e3:.2f} ms median of 6")
    if rank == 0:
        print("nccl check passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

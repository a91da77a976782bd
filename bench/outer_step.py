"""One outer round of the ``150m`` preset, split, beside its memory-traffic floor (issue 47).

The trainer's Llama at the ``150m`` preset (151.8M parameters, vocab 32000), AdamW's shape of
progress faked by a small move of every parameter, wrapped in ``DiLoCo`` on a 1-worker in-process
transport (the reduce is then the codec's encode, merge and decode in this process: no link), and
``--rounds`` rounds of ``sync()``, each after a fresh move. Per round, timed:

- ``outer step``: ``torch.optim.SGD(fused=True, nesterov=True)`` on the global copy, from its
  step pre-hook to its post-hook (public hooks of ``DiLoCo.outer_optimizer``);
- ``reduce``: ``RoundReport.comm_seconds`` (encode, merge, decode; int4: quantize and back);
- ``rest``: the round less both (pseudo-gradient, guard, error feedback, copy into the model).

The floor: fused Nesterov SGD must read the parameter, its gradient (the mean) and the momentum and
write the parameter and the momentum: 5 x 4 bytes per parameter; divided by this machine's memory
bandwidth, measured as the faster of ``dst.copy_(src)`` and an in-place ``mul_(1.0)`` over a tensor
of the same size (bytes read + written / s, best of ``--rounds``), with the same torch threads.

    python bench/outer_step.py --codec int4 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from diloco_core import DiLoCo, DiLoCoConfig
from diloco_train.model import Llama, ModelConfig
from transports import InProcessGroup

OUTER_BYTES = 5 * 4
"""Bytes per parameter a fused Nesterov SGD step reads and writes (param, grad, momentum in; param,
momentum out)."""


def bandwidth(numel: int, *, repeats: int) -> tuple[float, float]:
    """Bytes read plus written per second over ``numel`` fp32 values, the best of ``repeats``:
    ``dst.copy_(src)`` (8 bytes a value; a write to lines not read first may cost the CPU a read
    too) and ``x.mul_(1.0)`` in place (8 bytes a value, as the outer step's in-place updates)."""
    src = torch.ones(numel)
    dst = torch.empty(numel)
    ops = {"copy": lambda: dst.copy_(src), "in place": lambda: src.mul_(1.0)}
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(repeats + 1):  # the first touches dst's pages
        for name, op in ops.items():
            start = time.perf_counter()
            op()
            best[name] = min(best[name], time.perf_counter() - start)
    return 2 * 4 * numel / best["copy"], 2 * 4 * numel / best["in place"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codec", default="int4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--preset", default="150m")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Llama(ModelConfig(preset=args.preset).resolved())
    n = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = DiLoCoConfig(inner_steps=1, codec=args.codec)
    dl = DiLoCo(model, inner, InProcessGroup(1).transport(0), config)
    marks: list[float] = []
    dl.outer_optimizer.register_step_pre_hook(lambda *_: marks.append(time.perf_counter()))
    dl.outer_optimizer.register_step_post_hook(lambda *_: marks.append(time.perf_counter()))
    rows = []
    for r in range(args.rounds + 1):  # the first round warms up (pages, kernels)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
        marks.clear()
        start = time.perf_counter()
        report = dl.sync()
        total = time.perf_counter() - start
        outer = marks[1] - marks[0]
        if r > 0:
            rows.append((total, report.comm_seconds, outer, total - report.comm_seconds - outer))
    copy, in_place = bandwidth(n, repeats=args.rounds)
    floor = OUTER_BYTES * n / max(copy, in_place)
    threads = torch.get_num_threads()
    print(f"{args.preset}: {n / 1e6:.1f}M parameters, codec {args.codec}, torch threads {threads}")
    rates = f"copy {copy / 1e9:.2f} GB/s, in place {in_place / 1e9:.2f} GB/s (read + written)"
    print(f"memory bandwidth: {rates}; outer step floor {floor:.3f} s (the faster)")
    names = (
        "round",
        "reduce (encode, merge, decode)",
        "outer step",
        "rest (pseudo-gradient, copy back)",
    )
    for i, name in enumerate(names):
        values = [row[i] for row in rows]
        spread = f"min {min(values):.3f}  max {max(values):.3f}"
        print(f"{name:36s} median {statistics.median(values):.3f} s  {spread}")
    outer = [row[2] for row in rows]
    median, best = statistics.median(outer) / floor, min(outer) / floor
    print(f"outer step / floor: {median:.2f}x (median), {best:.2f}x (best)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Equal work = the code before elastic rounds, bit for bit: the global params after 3 lock-step rounds, per
transport x world size x codec, as a sha256 of their bytes. Run it in two trees and compare the JSON files:

    PYTHONPATH=$OLD/src:$OLD/tests python bench/equal_work_check.py old.json
    PYTHONPATH=src:tests python bench/equal_work_check.py new.json
    python -c "import json; a, b = (json.load(open(f)) for f in ('old.json', 'new.json')); print(a == b)"

Not part of the test run (about 3 minutes: gloo process groups and hivemind peers on 127.0.0.1).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile

import torch
from world import RankError, make_world

from diloco_core import DiLoCo, DiLoCoConfig

N = 700
CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "sign")
WORLDS = (("inprocess", (2, 3)), ("torch", (2, 3)), ("hivemind", (2,)))


def _run(transport, codec: str) -> str:
    rank = transport.rank
    model = torch.nn.Linear(N, 1, bias=False)
    with torch.no_grad():  # not the global generator: in-process ranks are threads
        model.weight.copy_(torch.randn(1, N, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DiLoCo(model, opt, transport, DiLoCoConfig(inner_steps=2, outer_lr=0.7, codec=codec, reduce_timeout=60.0))
    g = torch.Generator().manual_seed(7 + rank)
    while dl.round < 3:
        model.weight.grad = torch.randn(1, N, generator=g)
        dl.step()
    return hashlib.sha256(dl.global_params[0].detach().numpy().tobytes()).hexdigest()[:16]


def main(out_path: str) -> None:
    out = {}
    for kind, sizes in WORLDS:
        for n in sizes:
            world = make_world(kind, n, tempfile.mkdtemp(prefix="equal-work-"))
            try:
                for codec in CODECS:
                    fresh = {} if world.capabilities.fixed_ranks else {"fresh": True}  # a peer serves one DiLoCo
                    results = world.run(_run, codec, timeout=120, **fresh)
                    errors = [r for r in results if isinstance(r, RankError)]
                    out[f"{kind}-{n}-{codec}"] = f"ERROR {errors[0]}" if errors else sorted(set(results))
                    print(kind, n, codec, out[f"{kind}-{n}-{codec}"], flush=True)
            finally:
                world.close()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

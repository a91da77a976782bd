"""One process of tests/test_torch_auth.py's groups, joined through env:// (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), as anyone who reaches the rendezvous port can join.

``member TIMEOUT [SECRET_FILE]``: the torch transport (its secret from SECRET_FILE, else DILOCO_TORCH_SECRET, else
none); then a reduce of ``rank + 1``: prints ``averaged <mean>`` and exits 0, or ``refused: <error>`` and exits 3.
``silent``: a non-member that holds a rank slot and sends nothing. ``junk``: one that sends every rank random
bytes where a member sends its first message.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from diloco_core import TransportError
from transports import create_transport


def member(timeout: float, secret_file: str | None) -> int:
    section = {"kind": "torch", "timeout": timeout}
    if secret_file is not None:
        section["secret_file"] = secret_file
    try:
        transport = create_transport(section)
        x = torch.full((4,), float(transport.rank + 1))
        transport.all_reduce([x]).wait(timeout)
    except TransportError as e:
        print(f"refused: {e}", flush=True)
        return 3
    print(f"averaged {x[0].item()}", flush=True)
    transport.close()
    return 0


def non_member(junk: bool) -> int:
    dist.init_process_group("gloo")
    if junk:
        rank, world = dist.get_rank(), dist.get_world_size()
        junk_bytes = torch.randint(0, 256, (53,), dtype=torch.uint8)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, junk_bytes, r) for r in range(world) if r != rank]):
            work.wait()
    time.sleep(120)  # holds its slot until the test kills it
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    role = sys.argv[1]
    if role == "member":
        sys.exit(member(float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None))
    sys.exit(non_member(junk=role == "junk"))

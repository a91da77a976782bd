"""One DiLoCo peer over the hivemind transport, driven line by line on stdin (for tests/test_hivemind.py).

    python tests/hivemind_peer.py '{"name": 1, "transport": {...}, "die_flag": "/tmp/x"}'

Prints one JSON line per event on stdout: {"addr": [...]} once up, {"ready": ...} once DiLoCo is built
(state loaded from peers when joining), then one {"round": ...} or {"error": ...} per "round" command (``INNER_STEPS``
inner steps; with overlap, ``{"diloco": {"overlap": ...}}``, the round whose mean they applied) ("round-nan": a NaN enters this peer's
weights in the round's last step, as when its training diverges; round-die: the die flag is created before the
round's last step, so that the peer dies in the reduce that begins or finishes there).
"exit" closes the transport. With ``die_flag``: once that file exists, the peer kills its whole process
group (itself, its DHT, its averagers) and its p2pd (in a group of its own) with SIGKILL as soon as, acting as a reducer, it has
received a part of someone's tensors — a peer lost in the middle of an all-reduce.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import procs
import torch

from diloco_core import DiLoCo, DiLoCoConfig, TransportError
from transports.hivemind import HivemindConfig, HivemindFaults, HivemindTransport

INNER_STEPS = 2
REDUCE_TIMEOUT = 60.0


def say(**msg: object) -> None:
    print(json.dumps(msg), flush=True)


def digest(diloco: DiLoCo) -> str:
    h = hashlib.sha256()
    for p in diloco.global_params:
        h.update(p.detach().numpy().tobytes())
    for s in diloco.outer_optimizer.state.values():
        h.update(s["momentum_buffer"].numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    # Ctrl+C raises KeyboardInterrupt, as in a terminal's foreground script, even where the test run itself was
    # started with SIGINT ignored (a background job of a non-interactive shell), which this process inherits.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    flag = args.get("die_flag")

    def die() -> None:
        if os.path.exists(flag):
            for p in procs.descendants(os.getpid()):
                if p.name.startswith("p2pd"):
                    os.kill(p.pid, signal.SIGKILL)
            os.killpg(os.getpgid(0), signal.SIGKILL)

    faults = HivemindFaults(reducer_received_part=die if flag else None)
    # Small parts: many per all-reduce, so that a peer can die in the middle of one.
    transport = HivemindTransport(HivemindConfig(**args["transport"]), faults=faults, part_size_bytes=512)
    try:
        say(addr=transport.join_addresses)
        name = int(args["name"])
        torch.manual_seed(name)  # different initial weights on every peer: the broadcast must fix that
        overlap = args.get("diloco", {})  # e.g. {"overlap": "eager"}: DiLoCoConfig's overlap settings
        blocks = 2 if overlap.get("overlap") == "streaming" else 1  # streaming cuts a Sequential's blocks
        model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(blocks)))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        lr = {"outer_lr": 0.7} if overlap else {}  # set: where peers come and go the rule knows no M
        config = DiLoCoConfig(inner_steps=INNER_STEPS, codec="fp16", reduce_timeout=REDUCE_TIMEOUT, **overlap, **lr)
        diloco = DiLoCo(model, inner, transport, config)  # a joiner loads the run's state here (attach)
        say(ready=True, loaded=diloco.joined, round=diloco.round, digest=digest(diloco))
        data = torch.Generator().manual_seed(100 + name)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "exit":
                break
            if cmd not in ("round", "round-nan", "round-die"):  # round-nan: this peer's training diverges in the round
                continue
            report = None
            try:
                for step in range(INNER_STEPS):
                    x = torch.randn(16, 32, generator=data)
                    loss = (model(x) - x.flip(1)).pow(2).mean()
                    loss.backward()
                    if cmd == "round-nan" and step == INNER_STEPS - 1:
                        with torch.no_grad():
                            model[0].weight[0, 0] = float("nan")
                    if cmd == "round-die" and step == INNER_STEPS - 1 and flag:
                        open(flag, "w").close()  # armed: it dies in the next reduce it helps to reduce
                    report = diloco.step() or report  # streaming: the round's last fragment to finish
                    inner.zero_grad()
                if report is None:  # this peer was behind: its group's state replaced its own, its round dropped
                    say(round=diloco.round, replaced=True, digest=digest(diloco))
                    continue
                say(
                    round=report.round,
                    contributors=report.num_contributors,
                    digest=digest(diloco),
                    finite=all(bool(torch.isfinite(p).all()) for p in diloco.global_params),
                    comm_seconds=report.comm_seconds,
                    bytes_sent=report.bytes_sent,
                )
            except TransportError as e:
                inner.zero_grad()
                say(error=str(e), round=diloco.round)
    finally:
        transport.close()
    say(closed=True)


if __name__ == "__main__":
    main()

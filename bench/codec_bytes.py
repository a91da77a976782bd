"""Bytes on the wire and codec speed for a 25M-parameter flat model:

    python bench/codec_bytes.py [--values 918656] [--bytes-only]

Prints ``RoundReport.bytes_sent`` of one DiLoCo round between 2 in-process workers for each wire
(and its ratio to fp32; topk at 2 and 4 bits, density 1/64 and 1/32, block 256 and 4096, e.g.
``topk2-1/64-b256``), then, on one thread, the time to encode 25M values, to add one payload's
decoded values into an fp32 sum, to average two payloads (``Codec.mean_of``: what a transport does
with 2 workers), and error feedback's own cost per round (``ErrorFeedback.feed``: add the residual,
encode, decode, subtract); int8 and int4 with their fused CPU kernels and without (``-eager``); first, the
floor under every codec: reading 25M fp32 values once, and writing them once.
"""

from __future__ import annotations

import argparse
import copy
import threading
import time

import torch

from diloco_core import DiLoCo, DiLoCoConfig, codec_for
from diloco_core.codecs.names import codec_of
from diloco_core.feedback import ErrorFeedback
from transports import InProcessGroup

N, WIRES = 25_000_000, {w: {"codec": w} for w in ("fp32", "fp16", "int8", "int4", "int2", "sign")}
TOPK = {
    f"topk{bits}-1/{round(1 / d)}-b{block}": {
        "codec": "topk",
        "codec_value_bits": bits,
        "codec_density": d,
        "codec_block": block,
    }
    for bits in (2, 4)
    for d in (1 / 64, 1 / 32)
    for block in (256, 4096)
}
WIRES.update(TOPK)


def _bytes_sent(settings: dict, n: int) -> int:
    group, sent = InProcessGroup(2), {}

    def worker(rank: int) -> None:
        model = torch.nn.Linear(n, 1, bias=False)  # n trainable values
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = DiLoCoConfig(inner_steps=1, **settings)
        dl = DiLoCo(model, opt, transport=group.transport(rank), config=config)
        model.weight.grad = torch.full_like(model.weight, 1e-3 * (rank + 1))
        sent[rank] = dl.step().bytes_sent

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sent[0] == sent[1]
    return sent[0]


def _best_ms(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _times(codec) -> tuple[float, float, float, float]:
    x, total = torch.randn(N), torch.zeros(N)
    codec.prepare(x)  # block codecs: their kernels compiled before timing
    size, dtype = codec.payload_spec(N)
    payload, scratch = torch.empty(size, dtype=dtype), torch.empty(N)
    encode = _best_ms(lambda: codec.encode(x, out=payload))
    add = _best_ms(lambda: codec.decode(payload, total))
    mean = _best_ms(lambda: codec.mean_of([payload, payload], total, scratch))
    feedback = ErrorFeedback(codec, x, fed=N - 1, on=True)
    return encode, add, mean, _best_ms(lambda: feedback.feed(x))


def _eager(name: str):
    codec = copy.copy(codec_for(name))
    codec.fused = False
    return codec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=N, help="parameters of the flat model (the tiny model: 918656)")
    parser.add_argument("--bytes-only", action="store_true", help="bytes per round only, no timings")
    args = parser.parse_args()
    sent = {w: _bytes_sent(settings, args.values) for w, settings in WIRES.items()}
    for w in WIRES:
        print(f"{w}: bytes_sent {sent[w]:,} = {sent[w] / sent['fp32']:.4f} x fp32")
    if args.bytes_only:
        return
    torch.set_num_threads(1)
    x, out = torch.randn(N), torch.empty(N)
    read, write = _best_ms(lambda: x.amax()), _best_ms(lambda: out.zero_())
    print(f"the floor any codec's round pays, 1 thread, 25M values: read once {read:.1f} ms, write once {write:.1f} ms")
    for w in [*list(WIRES)[1:], "int8-eager", "int4-eager"]:
        codec = _eager(w.removesuffix("-eager")) if w.endswith("-eager") else codec_of(DiLoCoConfig(**WIRES[w]))
        encode, add, mean, feed = _times(codec)
        print(
            f"{w}, 1 thread, 25M values: encode {encode:.0f} ms, decode {add:.0f} ms, mean of 2 {mean:.0f} ms,"
            f" error feedback {feed:.0f} ms"
        )


if __name__ == "__main__":
    main()

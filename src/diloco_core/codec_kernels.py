"""Fused mean kernels for the block codecs on CPU, from ``torch.compile`` (Inductor's C++ backend).

Eager torch decodes and averages a chunk of payloads in a dozen passes (unpack, widen, scale, add,
divide), each a trip through the cache; one fused loop per chunk does it faster on one core (on 1M
values in cache: a mean of two int8 payloads 0.71 -> 0.10 ms, of two int4 payloads 1.0 -> 0.36 ms; on
25M values, written to memory, int8 15 -> 9 ms). A kernel computes exactly what the codec's eager code
computes, operation by operation (IEEE multiply, add and divide in the same order, no contraction into
fused multiply-adds: Inductor's default ``-ffp-contract=off``), so its means are bit-identical to the
eager ones (the tests check it): peers with and without kernels average together. Encoding stays eager:
compiled, it measured no faster (its max per block reads the values from memory either way); so does
the sign codec (its compiled decode measured no faster).

A kernel is compiled once per (bits, block, number of payloads), for any number of rows of whole blocks,
by ``Codec.prepare`` (``DiLoCo`` calls it when built), under a lock: never in a round, where seconds of
compiling would stall every peer. A codec without a compiled kernel runs eagerly, as does one where
compiling failed (no C++ compiler: one warning).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import types
from collections.abc import Callable

import torch

__all__ = ["BUILD_MIN_VALUES", "MIN_VALUES", "kernel", "kernels_available"]

MIN_VALUES = 2**18
"""Fewer values than this are averaged eagerly: a kernel call costs more than it saves there."""

BUILD_MIN_VALUES = 2**22
"""Kernels are compiled for models of at least this many values: below, seconds of compiling per process
outweigh what they save in a run."""

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_compiled: dict[tuple, Callable | bool] = {}  # False: compiling failed


def kernels_available(device: torch.device) -> bool:
    """Whether fused kernels can run for tensors on ``device``: on CPU, with a C++ compiler for Inductor."""
    # CUDA's eager kernels are fast enough; Inductor would need Triton there
    return device.type == "cpu" and _have_compiler()


@functools.cache
def _have_compiler() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c)


def kernel(
    *, device: torch.device, numel: int, block: int, bits: int, payloads: int, build: bool = False
) -> Callable | None:
    """``kernel(codes, scales, out)``: ``out`` = the mean of ``payloads`` payloads' decoded rows of whole
    blocks (int8 code rows: int8 codes or int4 nibbles; fp32 scales), for ``numel`` values of int8 or int4
    at ``block``, if it was compiled (or, with ``build``, compiled now unless ``numel < BUILD_MIN_VALUES``);
    None where the codec stays eager."""
    if numel < (BUILD_MIN_VALUES if build else MIN_VALUES) or not kernels_available(device):
        return None
    key = (block, bits, payloads)
    fn = _compiled.get(key)
    if fn is None and build:
        with _lock:
            if key not in _compiled:
                _compiled[key] = _compile(_mean_rows, block=block, bits=bits, payloads=payloads)
            fn = _compiled[key]
    return fn or None


def _compile(body: Callable, *, block: int, bits: int, payloads: int) -> Callable | bool:
    # a copy with a code object of its own: Dynamo caches graphs per code object, 8 at most
    body = types.FunctionType(body.__code__.replace(), body.__globals__, f"{body.__name__}_{len(_compiled)}")
    body.__kwdefaults__ = {"bits": bits}  # a constant to Dynamo
    compiled = torch.compile(body, dynamic=False, fullgraph=True)
    rows, width = 4, block * bits // 8
    codes = [torch.zeros(rows, width, dtype=torch.int8) for _ in range(payloads)]
    scales, out = [torch.zeros(rows) for _ in range(payloads)], torch.empty(rows * block)
    for t in (*codes, *scales, out):
        torch._dynamo.mark_dynamic(t, 0)  # any number of rows, one graph; the block stays static (vectorized)
    try:
        compiled(codes, scales, out)
    except Exception as e:  # noqa: BLE001 -- no compiler, or Inductor refused: eager is the same arithmetic
        logger.warning("codec kernels unavailable, using eager torch (%s: %s)", type(e).__name__, e)
        return False
    return compiled


def _mean_rows(codes: list[torch.Tensor], scales: list[torch.Tensor], out: torch.Tensor, *, bits: int) -> None:
    """``BlockCodec.mean_of`` on rows of whole blocks: int8 codes, or int4 (nibbles sign-extended, a block's
    first half low), times the scale, summed in order, divided."""
    acc = None
    for c, s in zip(codes, scales):
        if bits == 4:
            c = torch.cat(
                [torch.bitwise_right_shift(torch.bitwise_left_shift(c, 4), 4), torch.bitwise_right_shift(c, 4)], 1
            )
        d = c.to(torch.float32) * s[:, None]
        acc = d if acc is None else acc + d
    out.copy_((acc / len(codes)).view(-1))

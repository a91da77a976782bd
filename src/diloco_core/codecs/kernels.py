"""Fused encode and mean kernels for the block codecs on CPU, from ``torch.compile`` (Inductor's C++ backend).

Eager torch encodes, decodes and averages a chunk in a dozen passes (max, divide, round, clamp, pack;
unpack, widen, scale, add, divide), each a trip through the cache; a few fused loops per chunk do it
faster on one core (on 1M values in cache: a mean of two int8 payloads 0.71 -> 0.10 ms, of two int4
payloads 1.0 -> 0.36 ms; on 25M values, from and to memory: the mean of two int8 payloads 15 -> 9 ms,
encoding int8 15 -> 13 ms, int4 17 -> 13 ms). A kernel computes exactly what the codec's eager code
computes, operation by operation (IEEE multiply, add and divide in the same order, no contraction into
fused multiply-adds: Inductor's default ``-ffp-contract=off``), so its payloads and means are
bit-identical to the eager ones (the tests check it): peers with and without kernels average together.
The sign codec's bit planes unpack and pack in kernels too (its scale, a sum in a fixed order, stays eager).

A kernel is compiled once per (bits, block, number of payloads; or encoding), for any number of rows of
whole blocks, by ``Codec.prepare`` (``DiLoCo`` calls it when built, before a transport forks a process that
inherits it), under a lock: never in a round, where seconds of compiling would stall every peer. Without a
compiled kernel a codec runs eagerly, as where compiling failed (no C++ compiler: one warning)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import types
from collections.abc import Callable

import torch

__all__ = ["BUILD_MIN_VALUES", "MIN_VALUES", "compiled", "kernels_available"]

MIN_VALUES = 2**18
"""Fewer values than this are encoded and averaged eagerly: a kernel call costs more than it saves there."""

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


def compiled(
    what: str, *, block: int, bits: int, payloads: int = 0, numel: int, device: torch.device, build: bool = False
) -> Callable | None:
    """The fused kernel ``what`` for ``numel`` values of the codec of ``bits`` (8, 4 or 1) at ``block``, if it
    was compiled (or, with ``build``, compiled now unless ``numel < BUILD_MIN_VALUES``); None: stay eager.
    Rows of whole blocks; code rows are int8 (int8 codes, int4 nibbles or the sign codec's bit planes):
    ``"mean"``: ``(codes, scales, out)``, ``out`` = the mean of ``payloads`` payloads' decoded rows;
    ``"encode"``: ``(src, scales, codes) -> bool``, as the eager ``BlockCodec.encode``, False where a
    block's max is NaN or infinite (nothing valid written); ``"pack"``: ``(src, codes)``, the sign codec's
    bit planes (its scales stay eager: a sum, in its fixed order)."""
    if numel < (BUILD_MIN_VALUES if build else MIN_VALUES) or not kernels_available(device):
        return None
    if torch.is_inference_mode_enabled():  # its tensors' dispatch keys differ: a kernel would recompile
        return None
    key = (what, block, bits, payloads) if what == "mean" else (what, block, bits)
    fn = _compiled.get(key)
    if fn is None and build:
        with _lock:
            if key not in _compiled:
                _compiled[key] = _build(key)
            fn = _compiled[key]
    return fn or None


def _build(key: tuple) -> Callable | bool:
    what, block, bits, payloads = (*key, 0)[:4]  # ("mean", block, bits, payloads), or without payloads
    rows, width = 4, block * bits // 8  # warmed up on 4 rows: rows stay dynamic (0 and 1 are specialized)
    src, scales = torch.zeros(rows, block), torch.ones(rows)  # scales of 1: the coder divides by them
    if what == "pack":
        return _compile(_sign_rows, [src, torch.zeros(rows, width, dtype=torch.int8)], bits=bits)
    if what == "mean":
        codes = [torch.zeros(rows, width, dtype=torch.int8) for _ in range(payloads)]
        return _compile(_mean_rows, [codes, [scales.clone() for _ in codes], torch.empty(rows * block)], bits=bits)
    scaler = _compile(_scales_rows, [src, scales], bits=bits)
    coder = _compile(_codes_rows, [src, scales.clone(), torch.zeros(rows, width, dtype=torch.int8)], bits=bits)
    if not (scaler and coder):
        return False

    def encode_rows(src: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> bool:
        divisors, finite = scaler(src, scales)
        if not bool(finite):
            return False
        coder(src, divisors, codes)
        return True

    return encode_rows


def _compile(body: Callable, args: list, *, bits: int) -> Callable | bool:
    """``body`` compiled for ``bits`` and warmed up on ``args`` (each tensor's rows, or each list's
    tensors' rows, dynamic: any number of rows, one graph; the block stays static, so the loop is
    vectorized; fully dynamic shapes measured about 5x slower); False where compiling failed."""
    # a copy with a code object of its own: Dynamo caches graphs per code object, 8 at most
    body = types.FunctionType(body.__code__.replace(), body.__globals__, f"{body.__name__}_{len(_compiled)}")
    body.__kwdefaults__ = {"bits": bits}  # a constant to Dynamo
    # not guarded on the calling thread's global state (grad mode, torch's thread count): a hivemind
    # averager's executor threads differ from the thread that compiled, and each recompiled the kernels
    # in a round (a kernel keeps the thread count it was compiled with); its tensors' guards stay
    guards = {"guard_filter_fn": lambda entries: [e.guard_type != "GLOBAL_STATE" for e in entries]}
    for arg in args:
        for t in arg if isinstance(arg, list) else [arg]:
            torch._dynamo.mark_dynamic(t, 0)
    try:  # torch before 2.8 has no guard filter: eager there
        compiled = torch.compile(body, dynamic=False, fullgraph=True, options=guards)
        compiled(*args)
    except Exception as e:  # noqa: BLE001 -- no compiler, or Inductor refused: eager is the same arithmetic
        logger.warning("codec kernels unavailable, using eager torch (%s: %s)", type(e).__name__, e)
        return False
    return compiled


def _scales_rows(src: torch.Tensor, scales: torch.Tensor, *, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``BlockCodec.encode``'s scales: absmax / q per row (one step below where q * scale is inf), written
    to ``scales``; returns the rows' divisors (the scale, 1 for a zero block) and whether all were finite.
    Apart from ``_codes_rows``: fused, each vector's divisor was recomputed per block (measured slower)."""
    q = 2 ** (bits - 1) - 1
    absmax = torch.maximum(src.amax(1), src.amin(1).neg())
    scale = absmax / q
    scale = torch.where(torch.isinf(scale * q), scale.nextafter(scale.new_zeros(())), scale)
    scales.copy_(scale)
    return torch.where(scale > 0, scale, 1.0), torch.isfinite(absmax).all()


def _codes_rows(src: torch.Tensor, divisors: torch.Tensor, codes: torch.Tensor, *, bits: int) -> None:
    """``BlockCodec.encode``'s codes: round(value / divisor) clamped to [-q, q], int8, or int4 packed
    (a block's first half in the low nibbles)."""
    q = 2 ** (bits - 1) - 1
    x = (src / divisors[:, None]).round().clamp(-q, q)
    if bits == 4:  # packed in int32, then narrowed (measured faster than packing int8)
        x, half = x.to(torch.int32), src.shape[1] // 2
        x = torch.bitwise_or(torch.bitwise_left_shift(x[:, half:], 4), torch.bitwise_and(x[:, :half], 15))
    codes.copy_(x.to(torch.int8))


def _sign_rows(src: torch.Tensor, codes: torch.Tensor, *, bits: int) -> None:
    """``SignCodec.encode``'s codes: bit p of byte m is the sign bit of value p * block / 8 + m (-0.0 sets it)."""
    width, acc = src.shape[1] // 8, None
    for p in range(8):
        sign = torch.bitwise_and(
            torch.bitwise_right_shift(src[:, p * width : (p + 1) * width].view(torch.int32), 31), 1
        )
        acc = (
            torch.bitwise_left_shift(sign, p)
            if acc is None
            else torch.bitwise_or(acc, torch.bitwise_left_shift(sign, p))
        )
    codes.copy_(acc.to(torch.int8))


def _mean_rows(codes: list[torch.Tensor], scales: list[torch.Tensor], out: torch.Tensor, *, bits: int) -> None:
    """``BlockCodec.mean_of`` on rows of whole blocks: int8 codes, int4 (nibbles sign-extended, a block's
    first half low) times the scale, or sign (bit planes: a set bit decodes to -scale, as the eager code's
    sign bit ORed in: -0.0 for a zero scale); summed in order, divided."""
    acc = None
    for c, s in zip(codes, scales):
        if bits == 1:
            c = c.to(torch.int32)
            c = torch.cat([torch.bitwise_and(torch.bitwise_right_shift(c, p), 1) for p in range(8)], 1)
            # as eager: the sign bit ORed into the scale's bits (-0.0 for a zero scale; -|s| as a
            # where on -s.abs() was compiled without its abs)
            d = torch.bitwise_or(c * -(2**31), s.view(torch.int32)[:, None]).view(torch.float32)
        else:
            if bits == 4:
                c = torch.cat(
                    [torch.bitwise_right_shift(torch.bitwise_left_shift(c, 4), 4), torch.bitwise_right_shift(c, 4)], 1
                )
            d = c.to(torch.float32) * s[:, None]
        acc = d if acc is None else acc + d
    out.copy_((acc / len(codes)).view(-1))

"""Block codecs: int8 and int4, one fp32 scale per block of values, encoded and averaged chunk by chunk."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from .base import Codec
from .kernels import compiled

__all__ = ["INT4", "INT8", "BlockCodec", "check_block", "row_sums"]


class BlockCodec(Codec):
    """Blockwise absmax quantization to int8 (``bits=8``) or int4 (``bits=4``), one fp32 scale per block.

    Per block of ``block`` values: scale = absmax / q, code = round(value / scale) in [-q, q] (q = 127 or
    7), decoded as code * scale: within scale / 2 of the value, up to fp32 rounding; zeros stay exact.
    Payload, one uint8 tensor: ``ceil(numel / block)`` fp32 scales, then the codes, ``block`` bytes (int8)
    or ``block / 2`` (int4: the code's 4-bit two's complement per nibble, the block's first half low, its
    second half high) per block; a partial last block is encoded zero-padded (the sign codec: over its own
    values). Chunk by chunk, in small reused buffers; on CPU, encodes and means of whole blocks run as
    fused kernels once ``prepare`` compiled them (``kernels``: the same arithmetic, bit for bit)
    unless ``fused`` is False.
    """

    _encoding = "encode"  # the kernel that encodes (the sign codec's packs its bits)

    def __init__(self, name: str, bits: int, block: int = 256, *, fused: bool = True) -> None:
        check_block(block)
        self.name = name
        self.bits = bits
        self.block = block
        self.qmax = 2 ** (bits - 1) - 1
        self.layout = 2 if bits == 4 else 1
        self.fused = fused
        self._workspace = _Workspace()

    def __reduce__(self) -> tuple:  # a copy gets a workspace of its own (a thread-local cannot be pickled)
        return type(self), (self.name, self.bits, self.block), {"fused": self.fused}

    def with_block(self, block: int) -> BlockCodec:
        return type(self)(self.name, self.bits, block, fused=self.fused)

    def _fused(
        self, what: str, device: torch.device, numel: int, *, payloads: int = 0, build: bool = False
    ) -> Callable | None:
        """The compiled kernel ``what`` (``kernels.compiled``) for ``numel`` values; None: eager."""
        if not self.fused:
            return None
        args = {"block": self.block, "bits": self.bits, "payloads": payloads, "build": build}
        return compiled(what, numel=numel, device=device, **args)

    def prepare(self, like: torch.Tensor, *, payloads: Sequence[int] = (2,)) -> None:
        self._fused(self._encoding, like.device, like.numel(), build=True)
        for n in {1, *payloads}:
            self._fused("mean", like.device, like.numel(), payloads=n, build=True)

    def payload_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return -(-numel // self.block) * (4 + self.block * self.bits // 8), torch.uint8

    def _parts(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = -(-numel // self.block)  # (scales, codes as one row of bytes per block)
        return payload[: 4 * blocks].view(torch.float32), payload[4 * blocks :].view(
            blocks, self.block * self.bits // 8
        )

    def _chunks(self, numel: int, device: torch.device, *, acc: bool = False) -> Iterator[tuple]:
        """(blocks i:j, the slice of their values, a (j - i, block) fp32 buffer, an int8 one of that shape for
        int4's codes, a second fp32 one if ``acc``) per chunk of ~1M values, in this thread's workspace."""
        blocks, b = -(-numel // self.block), self.block
        rows = max(1, min(blocks, 2**20 // b))
        kept = device.type == "cpu"  # CUDA's allocator is cheap already, and a kept buffer would cross streams
        held = self._workspace.held if kept else None
        if kept:
            self._workspace.held = None  # in use: a nested call on this thread gets its own
        if held is None or held[0].shape[0] < rows or held[0].device != device or (acc and held[2] is None):
            int4_rows = rows if self.bits < 8 else 0  # int4 and the sign codec unpack their codes into it
            held = (
                torch.empty(rows, b, device=device),
                torch.empty(int4_rows, b, dtype=torch.int8, device=device),
                torch.empty(rows, b, device=device) if acc else None,
            )
        try:
            for i in range(0, blocks, rows):
                j = min(blocks, i + rows)
                second = held[2][: j - i] if acc else None
                yield i, j, slice(i * b, min(numel, j * b)), held[0][: j - i], held[1][: j - i], second
        finally:
            if kept:
                self._workspace.held = held

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = values.reshape(-1)
        if out is None:
            out = torch.empty(self.payload_spec(flat.numel())[0], dtype=torch.uint8, device=flat.device)
        scales, codes = self._parts(out, flat.numel())
        q, half, fused = self.qmax, self.block // 2, self._fused("encode", flat.device, flat.numel())
        for i, j, part, x, small, _ in self._chunks(flat.numel(), flat.device):
            src = blocks_of(flat, part, x)
            if fused is not None and j - i > 1 and fused(src, scales[i:j], codes[i:j].view(torch.int8)):
                continue  # else eager, which names a NaN's place
            scale = torch.div(self._absmax(src, part), q, out=scales[i:j])
            # absmax / q rounds up for absmax = fp32's max at q = 127: q * scale would decode to inf
            torch.where(torch.isinf(scale * q), scale.nextafter(scale.new_zeros(())), scale, out=scale)
            torch.div(src, torch.where(scale > 0, scale, 1.0)[:, None], out=x).round_().clamp_(-q, q)
            if self.bits == 8:
                codes[i:j].view(torch.int8).copy_(x)
                continue
            c = small.copy_(x)  # the codes as int8, then packed byte-wide: (hi << 4) | (lo & 15)
            packed = torch.bitwise_left_shift(c[:, half:], 4, out=codes[i:j].view(torch.int8))
            packed.bitwise_or_(c[:, :half].bitwise_and_(15))
        return out

    def _absmax(self, src: torch.Tensor, part: slice) -> torch.Tensor:
        """Each row's largest magnitude; ``ValueError`` naming ``part`` where a value is NaN or infinite."""
        absmax = torch.maximum(src.amax(1), src.amin(1).neg_())
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError(
                f"{self.name} cannot encode NaN or infinite values (one is in [{part.start}, {part.stop}))"
            )
        return absmax

    def _rows(
        self, scales: torch.Tensor, codes: torch.Tensor, *, i: int, j: int, out: torch.Tensor, small: torch.Tensor
    ) -> torch.Tensor:
        """Blocks i:j decoded into ``out`` (j - i rows of ``block`` values; int4 unpacks into ``small``)."""
        if self.bits == 8:
            out.copy_(codes[i:j].view(torch.int8))
        else:  # arithmetic shifts sign-extend each nibble; the int8 codes are widened in one copy
            packed, half = codes[i:j].view(torch.int8), self.block // 2
            torch.bitwise_left_shift(packed, 4, out=small[:, :half]).bitwise_right_shift_(4)
            torch.bitwise_right_shift(packed, 4, out=small[:, half:])
            out.copy_(small)
        return out.mul_(scales[i:j, None])

    def mean_of(
        self, payloads: Sequence[torch.Tensor], out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As ``Codec.mean_of``, value by value, but chunk by chunk in two small buffers (no ``scratch``), so
        ``out`` is written once instead of decoded into, added to and divided in place."""
        n = out.numel()
        for p in payloads:
            self.check(p, n)  # a peer's NaN or negative scale would be a silently wrong mean
        parts = [self._parts(p, n) for p in payloads]
        fused, b = self._fused("mean", out.device, n, payloads=len(payloads)), self.block
        for i, j, part, x, small, acc_rows in self._chunks(n, out.device, acc=True):
            whole = j if part.stop - part.start == x.numel() else j - 1  # blocks i:whole are whole
            if fused is not None and whole - i > 1:  # those in the kernel, a partial last block eagerly
                fused(
                    [c[i:whole].view(torch.int8) for _, c in parts],
                    [s[i:whole] for s, _ in parts],
                    out[i * b : whole * b],
                )
                if whole == j:
                    continue
                x, small, acc_rows, i, part = x[-1:], small[-1:], acc_rows[-1:], whole, slice(whole * b, part.stop)
            acc = self._rows(*parts[0], i=i, j=j, out=acc_rows, small=small)
            for scales, codes in parts[1:]:
                acc.add_(self._rows(scales, codes, i=i, j=j, out=x, small=small))
            torch.div(acc.view(-1)[: part.stop - part.start], len(payloads), out=out[part])
        return out

    def pieces(self, payloads: Sequence[torch.Tensor], numel: int, *, span: range, size: int) -> Iterator[torch.Tensor]:
        """As ``Codec.pieces``: whole blocks, about ``size`` values a piece, decoded into one small reused buffer
        (by the fused kernel of the mean of one payload where ``prepare`` compiled it; a partial block eagerly)."""
        parts, b, stop = [self._parts(p, numel) for p in payloads], self.block, span.stop
        blocks = -(-stop // b)
        rows = max(1, min(blocks, size // b))
        held = torch.empty(len(payloads), rows, b, device=payloads[0].device)
        small = torch.empty(rows if self.bits < 8 else 0, b, dtype=torch.int8, device=held.device)
        fused = self._fused("mean", held.device, numel, payloads=1)
        for i in range(span.start // b, blocks, rows):
            j = min(blocks, i + rows)
            whole = min(j, numel // b)  # blocks i:whole are whole: those in the kernel
            whole = whole if fused is not None and whole - i > 1 else i
            for (scales, codes), out in zip(parts, held):
                if whole > i:
                    fused([codes[i:whole].view(torch.int8)], [scales[i:whole]], out[: whole - i].view(-1))
                if whole < j:
                    self._rows(scales, codes, i=whole, j=j, out=out[whole - i : j - i], small=small[: j - whole])
            yield held[:, : j - i].reshape(len(payloads), -1)[:, : min(stop, j * b) - i * b]

    def check(self, payload: torch.Tensor, numel: int) -> None:
        super().check(payload, numel)
        scales = self._parts(payload, numel)[0]
        if not bool(((scales >= 0) & (scales * max(1, self.qmax) < float("inf"))).all()):  # False for NaN too
            raise ValueError(f"{self.name} payload holds a NaN, infinite or negative scale, or one that decodes to inf")


def blocks_of(flat: torch.Tensor, part: slice, x: torch.Tensor) -> torch.Tensor:
    """``flat[part]`` as ``x``'s rows of blocks: in place when it fills them, else copied into ``x``, zero-padded."""
    if part.stop - part.start == x.numel() and flat.is_contiguous():  # whole blocks: read in place, no copy
        return flat[part].view(x.shape)
    x.view(-1)[part.stop - part.start :].zero_()
    x.view(-1)[: part.stop - part.start].copy_(flat[part])
    return x


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each row's sum in the same order whatever the number of rows (a transport encodes a slice alone that
    another encodes in a larger chunk): sums of at most 256 values, which torch never splits across threads."""
    n = rows.shape[1]
    return rows.view(rows.shape[0], -1, min(n, 256)).sum(2).sum(1) if n > 256 else rows.sum(1)


class _Workspace(threading.local):
    """A thread's chunk buffers, kept from call to call (fresh ones cost more in page faults than the arithmetic)."""

    held: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None


def check_block(block: object, name: str = "block") -> None:
    """Raise ``ValueError`` unless ``block`` is a block codec's valid number of values per scale."""
    if not (
        isinstance(block, int) and not isinstance(block, bool) and 16 <= block <= 2**16 and block & (block - 1) == 0
    ):
        raise ValueError(f"{name}={block!r} is invalid: expected a power of two in [16, 65536]")


INT8 = BlockCodec("int8", bits=8)
INT4 = BlockCodec("int4", bits=4)

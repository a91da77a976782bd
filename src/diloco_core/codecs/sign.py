"""The 1-bit codec: each value's sign, and one fp32 scale per block, the block's mean |x|.

A value costs one bit, so a payload is 1/32 of fp32 plus 4 bytes per block (0.035x at block 256). What
it drops is large: per block ||x||^2 - ||x||_1^2 / n of the squared norm (the mean |x| is the scale that
minimizes it; about 36% for Gaussian values), so it is meant for error feedback, which carries what was
dropped into the next round (error-feedback signSGD: Karimireddy et al. 2019). Its bits travel as eight
bit planes per block, each a contiguous eighth of it, so packing and unpacking are whole-vector shifts
(and the mean of payloads a fused CPU kernel, ``kernels``).
"""

from __future__ import annotations

import torch

from .block import BlockCodec, blocks_of, row_sums

__all__ = ["SignCodec"]

_PLANE_BITS = (1, 2, 4, 8, 16, 32, 64, -128)  # bit p of an int8 code byte


class SignCodec(BlockCodec):
    """Per block of ``block`` values: scale = mean |x| over its values (a partial last block's own count),
    code = the sign bit (-0.0 counts as negative), decoded as -scale or +scale; an all-zero block decodes
    to zeros. Payload, one uint8 tensor: ``ceil(numel / block)`` fp32 scales, then ``block / 8`` bytes per
    block in bit planes: bit p of byte m is set for a negative value p * block / 8 + m (``layout`` 2; 1,
    before: bit k of byte m for value 8m + k)."""

    _encoding = "pack"

    def __init__(self, name: str = "sign", bits: int = 1, block: int = 256, *, fused: bool = True) -> None:
        if bits != 1:
            raise ValueError(f"bits={bits!r} is invalid: the sign codec sends 1 bit per value")
        if isinstance(block, int) and block < 32:  # 4 bytes of scale + 2 of codes: payloads side by side misalign
            raise ValueError(f"block={block!r} is invalid for the sign codec: expected a power of two in [32, 65536]")
        super().__init__(name, bits=1, block=block, fused=fused)
        self.layout = 2

    def pad(self, flat: torch.Tensor, numel: int) -> None:
        """The padding holds the block's mean |x| over its own values (zeros would count in its mean)."""
        own = flat[numel - numel % self.block : numel]
        if own.numel():
            flat[numel : numel - own.numel() + self.block].fill_(torch.mean(own.abs(), dtype=torch.float64))

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat, n = values.reshape(-1), values.numel()
        if out is None:
            out = torch.empty(self.payload_spec(n)[0], dtype=torch.uint8, device=flat.device)
        scales, codes = self._parts(out, n)
        fused = self._fused("pack", flat.device, n)
        for i, j, part, x, small, spare in self._chunks(n, flat.device, acc=True):
            src = blocks_of(flat, part, x)
            magnitudes = torch.abs(src, out=spare)
            counts = torch.full((j - i, 1), float(self.block), device=flat.device)
            counts[-1] = part.stop - part.start - (j - i - 1) * self.block  # a partial last block: its own values
            scale = torch.div(row_sums(magnitudes), counts[:, 0], out=scales[i:j])
            if not bool(torch.isfinite(scale).all()):
                if not bool(torch.isfinite(src).all()):
                    raise ValueError(
                        f"{self.name} cannot encode NaN or infinite values (one is in [{part.start}, {part.stop}))"
                    )
                # a sum past fp32's max: those rows divided first (the mean is at most the largest |x|)
                divided = row_sums(magnitudes.div_(counts)).clamp_(max=torch.finfo(torch.float32).max)
                torch.where(torch.isfinite(scale), scale, divided, out=scale)
            packed = codes[i:j].view(torch.int8)
            if fused is not None and j - i > 1:
                fused(src, packed)
                continue
            signs = torch.bitwise_right_shift(src.view(torch.int32), 31, out=spare.view(torch.int32))  # -1: negative
            planes = small.copy_(signs).view(j - i, 8, -1)  # one byte per value: 0xFF or 0
            torch.bitwise_and(planes[:, 0], 1, out=packed)
            for p in range(1, 8):
                packed.bitwise_or_(planes[:, p].bitwise_and_(_PLANE_BITS[p]))
        return out

    def _rows(
        self, scales: torch.Tensor, codes: torch.Tensor, *, i: int, j: int, out: torch.Tensor, small: torch.Tensor
    ) -> torch.Tensor:
        """Blocks i:j decoded into ``out`` as the scale's bits with the code's sign bit (exact: +-scale)."""
        packed, planes = codes[i:j].view(torch.int8)[:, None], small.view(j - i, 8, -1)
        shifts = torch.arange(8, dtype=torch.int8, device=packed.device)[:, None]  # one per plane
        torch.bitwise_right_shift(packed, shifts, out=planes).bitwise_and_(1)  # bit 7 of a negative byte: -1, masked
        bits = out.view(torch.int32)
        bits.copy_(small).bitwise_left_shift_(31)  # the fp32 sign bit alone
        return bits.bitwise_or_(scales[i:j].view(torch.int32)[:, None]).view(torch.float32)

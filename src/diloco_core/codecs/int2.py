"""The 2-bit codec: per block one fp32 scale and each value's nearest of four levels, -1, -1/3, +1/3, +1 times it.

The scale is min(absmax, 1.5 x RMS) of the block, not its absmax: with the absmax most values fall on
+-absmax / 3, far above their size wherever one value stands out, and a round trip lost 36% of a Gaussian
block's squared norm (as much as the 1-bit sign codec), 106% of a Laplace one's; with 1.5 RMS (near the
best even spacing for Gaussian values) 12% and 20%, the few values beyond the scale clipped to it. No level
is zero (it would cost one of four codes and leave the levels lopsided): a zero inside a nonzero block
decodes to +scale / 3, a block of zeros to +0.0, a block of one repeated value (the guard's tail blocks)
exactly, its RMS being its absmax. A payload is 1/16 of fp32 plus 4 bytes per block (0.066x at block 256).
It drops much: meant for error feedback, whose residual stays within c / (1 - c) of the largest block absmax
fed, c = 1 - 1.5 / sqrt(block) (the scale is at least 1.5 / sqrt(block) of the absmax: no value loses more).
"""

from __future__ import annotations

import torch

from .block import BlockCodec, blocks_of, row_sums

__all__ = ["Int2Codec"]


class Int2Codec(BlockCodec):
    """Per block of ``block`` values (a partial last block: its own values): r = min(1, 1.5 RMS(x / absmax)),
    scale = absmax * r, code k = floor(1.5 * clamp(x / absmax / r, -1, 1) + 2) in 0..3 (the nearest level; a
    zero to the upper one), decoded as ((2k - 3) * fp32(1/3)) * scale, the first product exactly -1, -1/3,
    1/3 or 1 in fp32: within scale / 3 of each value up to the scale, and max(scale / 3, absmax - scale) of
    any. Payload, one uint8 tensor: ``ceil(numel / block)`` fp32 scales, then ``block / 4`` bytes per block
    in quarters: bits 2p and 2p + 1 of byte m hold the code of value p * block / 4 + m, so packing and
    unpacking are whole-vector shifts. Eager only: no fused kernels."""

    def __init__(self, name: str = "int2", bits: int = 2, block: int = 256, *, fused: bool = False) -> None:
        if bits != 2:
            raise ValueError(f"bits={bits!r} is invalid: the int2 codec sends 2 bits per value")
        super().__init__(name, bits=2, block=block, fused=False)  # qmax 1: its scale times 1 must be finite

    def pad(self, flat: torch.Tensor, numel: int) -> None:
        """The padding holds the RMS of its block's own values (zeros would lower the block's RMS, so its scale)."""
        own = flat[numel - numel % self.block : numel]
        if own.numel():
            flat[numel : numel - own.numel() + self.block].fill_(own.double().square().mean().sqrt())

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat, n = values.reshape(-1), values.numel()
        if out is None:
            out = torch.empty(self.payload_spec(n)[0], dtype=torch.uint8, device=flat.device)
        scales, codes = self._parts(out, n)
        for i, j, part, x, small, spare in self._chunks(n, flat.device, acc=True):
            src = blocks_of(flat, part, x)
            absmax = self._absmax(src, part)
            y = torch.div(src, torch.where(absmax > 0, absmax, 1.0)[:, None], out=spare)  # in [-1, 1]: no overflow
            counts = torch.full((j - i,), float(self.block), device=flat.device)
            counts[-1] = part.stop - part.start - (j - i - 1) * self.block
            r = row_sums(torch.mul(y, y, out=x)).div_(counts).sqrt_().mul_(1.5).clamp_(max=1.0)  # 0: a zero block
            torch.mul(absmax, r, out=scales[i:j]).abs_()  # +0.0 for a block of -0.0, whose absmax is -0.0
            y.div_(torch.where(r > 0, r, 1.0)[:, None]).clamp_(-1.0, 1.0).mul_(1.5).add_(2.0).floor_()
            quarters = small.copy_(y).view(j - i, 4, -1)
            quarters.bitwise_left_shift_(_shifts(flat.device))
            packed = torch.bitwise_or(quarters[:, 0], quarters[:, 1], out=codes[i:j].view(torch.int8))
            packed.bitwise_or_(quarters[:, 2]).bitwise_or_(quarters[:, 3])
        return out

    def _rows(
        self, scales: torch.Tensor, codes: torch.Tensor, *, i: int, j: int, out: torch.Tensor, small: torch.Tensor
    ) -> torch.Tensor:
        """Blocks i:j decoded into ``out``: each quarter's codes shifted out of the bytes at once."""
        quarters = small.view(j - i, 4, -1)
        torch.bitwise_right_shift(codes[i:j].view(torch.int8)[:, None], _shifts(out.device), out=quarters)
        levels = out.copy_(small.bitwise_and_(3).mul_(2).sub_(3)).mul_(1 / 3)  # 3 * fp32(1/3) rounds to 1
        return levels.mul_(scales[i:j, None])


def _shifts(device: torch.device) -> torch.Tensor:
    """The bit offset of each quarter's codes in a byte, one row per quarter."""
    return torch.arange(0, 8, 2, dtype=torch.int8, device=device)[:, None]

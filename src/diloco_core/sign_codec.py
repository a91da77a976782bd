"""The 1-bit codec: each value's sign, and one fp32 scale per block, the block's mean |x|.

A value costs one bit, so a payload is 1/32 of fp32 plus 4 bytes per block (0.035x at block 256). What
it drops is large: per block ||x||^2 - ||x||_1^2 / n of the squared norm (the mean |x| is the scale that
minimizes it; about 36% for Gaussian values), so it is meant for error feedback, which carries what was
dropped into the next round (error-feedback signSGD: Karimireddy et al. 2019). Its bits are packed and
unpacked eight at a time in int64 words, so a payload's layout assumes a little-endian host (as fp32
scales on the wire already do).
"""

from __future__ import annotations

import torch

from .block_codec import BlockCodec, _blocks_of

__all__ = ["SignCodec"]

_LOW_BITS = 0x0101010101010101  # bit 0 of each of a word's 8 bytes
_GATHER = 0x0102040810204080  # word * _GATHER: bit 0 of byte k lands on bit 56 + k
_BIT_K = 0x8040201008040201 - 2**64  # bit k of byte k (as int64)
_HIGH_BITS = 0x8080808080808080 - 2**64  # bit 7 of each byte
_CARRY = 0x7F7F7F7F7F7F7F7F  # + byte: bit 7 set iff the byte was not 0 (no carry between bytes below 0x81)


class SignCodec(BlockCodec):
    """Per block of ``block`` values: scale = mean |x| over its values (a partial last block's own count),
    code = the sign bit (-0.0 counts as negative), decoded as -scale or +scale; an all-zero block decodes
    to zeros. Payload, one uint8 tensor: ``ceil(numel / block)`` fp32 scales, then ``block / 8`` bytes per
    block, byte m holding the signs of values 8m..8m+7 of it, bit k set for a negative value 8m + k."""

    def __init__(self, name: str = "sign", bits: int = 1, block: int = 256) -> None:
        if bits != 1:
            raise ValueError(f"bits={bits!r} is invalid: the sign codec sends 1 bit per value")
        if isinstance(block, int) and block < 32:  # 4 bytes of scale + 2 of codes: payloads side by side misalign
            raise ValueError(f"block={block!r} is invalid for the sign codec: expected a power of two in [32, 65536]")
        super().__init__(name, bits=1, block=block)

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat, n = values.reshape(-1), values.numel()
        if out is None:
            out = torch.empty(self.payload_spec(n)[0], dtype=torch.uint8, device=flat.device)
        scales, codes = self._parts(out, n)
        for i, j, part, x, small, spare in self._chunks(n, flat.device, acc=True):
            src = _blocks_of(flat, part, x)
            signs = torch.bitwise_right_shift(src.view(torch.int32), 31, out=spare.view(torch.int32))  # -1: negative
            small.copy_(signs)  # one byte per value: 0xFF or 0
            magnitudes = torch.abs(src, out=spare)
            counts = torch.full((j - i, 1), float(self.block), device=flat.device)
            counts[-1] = part.stop - part.start - (j - i - 1) * self.block  # a partial last block: its own values
            scale = torch.div(_row_sums(magnitudes), counts[:, 0], out=scales[i:j])
            if not bool(torch.isfinite(scale).all()):
                if not bool(torch.isfinite(src).all()):
                    raise ValueError(
                        f"{self.name} cannot encode NaN or infinite values (one is in [{part.start}, {part.stop}))"
                    )
                # a sum past fp32's max: those rows divided first (the mean is at most the largest |x|)
                divided = _row_sums(magnitudes.div_(counts)).clamp_(max=torch.finfo(torch.float32).max)
                torch.where(torch.isfinite(scale), scale, divided, out=scale)
            words = small.view(-1).view(torch.int64)  # 8 values' sign bytes per word
            words.bitwise_and_(_LOW_BITS).mul_(_GATHER).bitwise_right_shift_(56)
            codes[i:j].view(-1).copy_(words)  # each word's low byte: the 8 sign bits
        return out

    def _rows(
        self, scales: torch.Tensor, codes: torch.Tensor, *, i: int, j: int, out: torch.Tensor, small: torch.Tensor
    ) -> torch.Tensor:
        """Blocks i:j decoded into ``out`` as the scale's bits with the code's sign bit (exact: +-scale)."""
        words = small.view(-1).view(torch.int64)
        words.copy_(codes[i:j].view(-1))  # one code byte per word, then spread: byte k gets bit k of it
        words.mul_(_LOW_BITS).bitwise_and_(_BIT_K).add_(_CARRY).bitwise_and_(_HIGH_BITS)  # byte k: 0x80 if set
        bits = out.view(torch.int32)
        bits.copy_(small).bitwise_left_shift_(24)  # int8 0x80 = -128, shifted: the fp32 sign bit alone
        return bits.bitwise_or_(scales[i:j].view(torch.int32)[:, None]).view(torch.float32)


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each row's sum in the same order whatever the number of rows (a transport encodes a slice alone that
    another encodes in a larger chunk): sums of at most 256 values, which torch never splits across threads."""
    n = rows.shape[1]
    return rows.view(rows.shape[0], -1, min(n, 256)).sum(2).sum(1) if n > 256 else rows.sum(1)

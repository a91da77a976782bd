"""The sparse codec: of each block, only its k values of largest |x|, as their indices and a few bits each.

Per block of ``block`` values it sends k = round(density * block) values (at the defaults, density 1/64 at block
256: 4), each as its index in the block (log2(block) bits) and a level of ``value_bits`` bits, plus the block's
fp32 scale: 4 + ceil(k (log2(block) + value_bits) / 8) bytes per block, 9 at the defaults (0.0088x fp32, a
quarter of the sign codec's). What it drops is most of the values, so it is meant for error feedback, which
carries each dropped value into the next rounds until it is among the largest (sparsified SGD with memory:
Stich et al. 2018; Deep Gradient Compression, Lin et al. 2018). Encoding is a ``topk`` per block on a key that
makes ties deterministic; averaging adds each payload's k values per block into the sum (no dense decode).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .base import Codec, CodecId
from .block import check_block

__all__ = ["DENSITY", "TopKCodec"]

DENSITY = 1 / 64
"""The share of each block's values the sparse codec sends unless told otherwise (``codec_density``)."""

_ROWS = 2**20  # values encoded per chunk: the key's int64 temporaries stay small


class TopKCodec(Codec):
    """Per block of ``block`` values: keep the k values of largest |x|, ties broken by the lowest index first;
    scale = the largest kept |x|; each kept value becomes the nearest level of a grid without zero, ±(2j + 1) /
    (2^bits - 1) for j < 2^(bits - 1) (2 bits: ±1/3, ±1; 4 bits: ±1/15 ... ±1), decoded as scale times its level:
    within scale / (2^bits - 1) of the value, and the largest one exact (level 1); a kept zero (in a block of
    fewer than k non-zero values) decodes to scale / (2^bits - 1). Every value not kept decodes to +0.0, as does
    a block of zeros (scale 0). So a block of one repeated value keeps its first k positions
    and decodes exactly there, at its first position too: the contribution guard's tail (valid flag, work,
    digest) is read there. Payload, one uint8 tensor: ``ceil(numel / block)`` fp32 scales (as bytes), then per
    block ``ceil(k * width / 8)`` bytes: its k fields of width = log2(block) + bits bits, ``index << bits |
    code`` (code j: the j-th level, code 2^(bits-1) + j: its negative), by ascending index, bit i of the stream
    being bit i % 8 of byte i // 8. A partial last block is encoded zero-padded, with the same k: where it holds fewer than k
    values, its padding fills the rest (indices below k), decoded and dropped."""

    name = "topk"

    def __init__(self, block: int = 256, *, density: float = DENSITY, value_bits: int = 2) -> None:
        check_block(block)
        if not (isinstance(density, (int, float)) and not isinstance(density, bool) and 0 < density <= 0.5):
            raise ValueError(f"density={density!r} is invalid: expected a number in (0, 0.5]")
        if not isinstance(value_bits, int) or value_bits not in (2, 4):  # True == 1, 2.0 is no int
            raise ValueError(f"value_bits={value_bits!r} is invalid: expected 2 or 4")
        self.block, self.density, self.value_bits = block, density, value_bits
        self.k = int(density * block + 0.5)  # rounded half up
        if self.k < 1:
            raise ValueError(
                f"density={density!r} is invalid at block={block}: it keeps round({density * block:g}) = 0 values "
                f"per block; expected a density >= {0.5 / block:g} (density * block >= 0.5) or a larger block"
            )
        self.index_bits = block.bit_length() - 1
        self.width = self.index_bits + value_bits
        self.code_bytes = -(-self.k * self.width // 8)
        steps, half = 2**value_bits - 1, 2 ** (value_bits - 1)
        levels = [(2 * j + 1) / steps for j in range(half)]  # the last one is 1.0: the scale decodes exactly
        self._levels = torch.tensor(levels + [-v for v in levels])

    @property
    def identity(self) -> CodecId:
        """Its value bits and k too: ``topk2k4b256`` (2 bits, 4 values per block of 256)."""
        return CodecId(self.name, self.block, self.layout, variant=f"{self.value_bits}k{self.k}")

    def with_block(self, block: int) -> TopKCodec:
        return TopKCodec(block, density=self.density, value_bits=self.value_bits)

    def payload_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return -(-numel // self.block) * (4 + self.code_bytes), torch.uint8

    def _codes(self, payload: torch.Tensor, blocks: int) -> torch.Tensor:
        """The payload's code bytes, one row per block."""
        return payload[4 * blocks :].view(blocks, self.code_bytes)

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat, n, b, k = values.reshape(-1), values.numel(), self.block, self.k
        if out is None:
            out = torch.empty(self.payload_spec(n)[0], dtype=torch.uint8, device=flat.device)
        codes = self._codes(out, -(-n // b))
        tiebreak = torch.arange(b - 1, -1, -1, device=flat.device)  # among equal |x|, the lower index is larger
        for i, j in self._spans(n):
            part = flat[i * b : min(n, j * b)]  # a partial last block zero-padded, as ``Codec.pad`` pads it
            x = torch.nn.functional.pad(part, (0, (j - i) * b - part.numel())).view(j - i, b)
            # |x|'s bits order as |x| does (NaN and inf above every finite value); the index below them
            key = (x.contiguous().view(torch.int32) & 0x7FFFFFFF).long().bitwise_left_shift_(self.index_bits)
            index = (b - 1) - (key.bitwise_or_(tiebreak).topk(k, 1, sorted=False).values & (b - 1))
            index = index.sort(1).values
            kept = x.gather(1, index)
            scale = kept.abs().amax(1)
            if not bool(torch.isfinite(scale).all()):
                at = i + int((~torch.isfinite(scale)).nonzero()[0])
                raise ValueError(
                    f"topk cannot encode NaN or infinite values (one is in [{at * b}, {min(n, at * b + b)}))"
                )
            out[4 * i : 4 * j].copy_(scale.view(torch.uint8))  # as bytes: a payload may start at any byte
            codes[i:j] = self._pack(index, self._level_codes(kept, scale))
        return out

    def _level_codes(self, kept: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Each kept value's nearest level: j = floor(|x| / scale * (2^bits - 1) / 2), plus 2^(bits-1) if x < 0."""
        half = 2 ** (self.value_bits - 1)
        t = kept / torch.where(scale > 0, scale, 1.0)[:, None]  # in [-1, 1], exactly ±1 at the largest
        j = t.abs().mul_(2 * half - 1).div_(2, rounding_mode="floor").clamp_(max=half - 1).long()
        return j.add_((t < 0).long() * half)

    def _pack(self, index: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """Rows of k fields ``index << bits | code`` as rows of ``code_bytes`` bytes (bit i at bit i % 8 of byte i // 8)."""
        fields = index.bitwise_left_shift(self.value_bits).bitwise_or_(code)
        bits = fields[:, :, None].bitwise_right_shift(torch.arange(self.width, device=fields.device)).bitwise_and_(1)
        stream = bits.new_zeros(fields.shape[0], self.code_bytes * 8)
        stream[:, : self.k * self.width] = bits.view(fields.shape[0], -1)
        weights = torch.arange(8, device=fields.device)
        return stream.view(fields.shape[0], -1, 8).bitwise_left_shift_(weights).sum(2).to(torch.uint8)

    def _blocks(self, payload: torch.Tensor, numel: int, *, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks i:j of a received payload as (positions from block i's start, decoded values), k per block;
        ``ValueError`` where it is malformed: its shape or dtype, a NaN, infinite or negative scale, indices not
        strictly increasing in a block, or past the last block's own values (its padding, where fewer than k)."""
        Codec.check(self, payload, numel)  # its shape and dtype (``self.check`` is this)
        blocks, b = -(-numel // self.block), self.block
        scale = payload[4 * i : 4 * j].clone().view(torch.float32)  # copied: a payload may start at any byte
        if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
            raise ValueError("topk payload holds a NaN, infinite or negative scale")
        bit = torch.arange(max(8, self.width), device=payload.device)
        stream = self._codes(payload, blocks)[i:j, :, None].long().bitwise_right_shift(bit[:8]).bitwise_and_(1)
        bits = stream.view(j - i, self.code_bytes * 8)[:, : self.k * self.width].reshape(j - i, self.k, self.width)
        fields = bits.bitwise_left_shift_(bit[: self.width]).sum(2)
        index, code = fields.bitwise_right_shift(self.value_bits), fields.bitwise_and_(2**self.value_bits - 1)
        if self.k > 1 and not bool((index[:, 1:] > index[:, :-1]).all()):
            raise ValueError("topk payload holds indices that are not strictly increasing within a block")
        if j == blocks and j > i and int(index[-1, -1]) >= max(self.k, numel - (blocks - 1) * b):
            raise ValueError(f"topk payload holds an index past the last block's {numel - (blocks - 1) * b} values")
        positions = index.add_(torch.arange(0, (j - i) * b, b, device=payload.device)[:, None]).view(-1)
        return positions, (scale[:, None] * self._levels.to(payload.device)[code]).view(-1)

    def _spans(self, numel: int) -> Iterator[tuple[int, int]]:
        """Blocks ``i:j`` a chunk at a time (decoding unpacks each code bit into an int64: the dense size)."""
        blocks, rows = -(-numel // self.block), max(1, _ROWS // self.block)
        return ((i, min(blocks, i + rows)) for i in range(0, blocks, rows))

    def check(self, payload: torch.Tensor, numel: int) -> None:
        for i, j in self._spans(numel):
            self._blocks(payload, numel, i=i, j=j)

    def mean_of(
        self, payloads: Sequence[torch.Tensor], out: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As ``Codec.mean_of``: each payload's kept values added, in order, into a zeroed ``out`` (a value not
        kept adds +0.0 in the plain definition, which changes no sum: ``out`` never holds -0.0), then divided."""
        assert payloads, "a mean needs at least one contribution"
        n = out.numel()
        out.zero_()
        for i, j in self._spans(n):
            for p in payloads:  # in contributor order within each chunk: each value's sum is in that order
                positions, values = self._blocks(p, n, i=i, j=j)
                if j * self.block > n:  # the last block's padding is dropped
                    own = positions < n - i * self.block
                    positions, values = positions[own], values[own]
                out[i * self.block : j * self.block].index_add_(0, positions, values)  # a block's indices differ
        return out.div_(len(payloads))

    def pieces(self, payloads: Sequence[torch.Tensor], numel: int, *, span: range, size: int) -> Iterator[torch.Tensor]:
        """As ``Codec.pieces``: whole blocks, about ``size`` values a piece, decoded into one small reused buffer."""
        b, stop = self.block, span.stop
        blocks = -(-stop // b)
        rows = max(1, min(blocks, size // b))
        held = torch.empty(len(payloads), rows * b, device=payloads[0].device)
        for i in range(span.start // b, blocks, rows):
            j = min(blocks, i + rows)
            held.zero_()
            for p, out in zip(payloads, held):
                out.index_add_(0, *self._blocks(p, numel, i=i, j=j))
            yield held[:, : min(stop, j * b) - i * b]

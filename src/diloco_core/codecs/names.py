"""The codecs config can name (``[diloco] codec``), and how a name or a ``Codec`` becomes one."""

from __future__ import annotations

from typing import Protocol

from .base import BF16, FP16, FP32, Codec
from .block import INT4, INT8
from .int2 import Int2Codec
from .sign import SignCodec
from .sparse import DENSITY, TopKCodec

__all__ = ["CODECS", "INT2", "SIGN", "WireSettings", "check_codec", "codec_for", "codec_of"]

SIGN = SignCodec("sign")
INT2 = Int2Codec("int2")

CODECS: dict[str, Codec] = {c.name: c for c in (FP32, FP16, BF16, INT8, INT4, INT2, SIGN, TopKCodec())}
"""The codecs config can name (block codecs with the default block of 256 values; topk at its defaults)."""


def codec_for(name: str | Codec, block: int = 256, *, density: float = DENSITY, value_bits: int = 2) -> Codec:
    """The codec called ``name`` (a ``Codec`` is returned as is); a block codec with ``block`` values per scale,
    topk sending ``density`` of them in ``value_bits`` bits each (``TopKCodec``; the other codecs ignore these)."""
    if isinstance(name, Codec):
        return name
    try:
        codec = CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"codec={name!r} is invalid: expected one of {sorted(CODECS)}") from None
    if isinstance(codec, TopKCodec) and (density, value_bits) != (codec.density, codec.value_bits):
        return TopKCodec(block, density=density, value_bits=value_bits)
    return codec if type(block) is int and block == codec.block else codec.with_block(block)


class WireSettings(Protocol):
    """A config's wire settings (``DiLoCoConfig``'s, which imports this module)."""

    codec: str
    codec_block: int
    codec_density: float
    codec_value_bits: int


def codec_of(config: WireSettings, name: str | None = None) -> Codec:
    """The codec ``name`` (``config.codec`` if None) at ``config``'s block, and topk's density and value bits."""
    d, bits = config.codec_density, config.codec_value_bits
    return codec_for(name or config.codec, config.codec_block, density=d, value_bits=bits)


def check_codec(codec: object) -> Codec:
    """``codec`` if it is a ``Codec``; a clear ``ValueError`` otherwise (a transport's input check)."""
    if not isinstance(codec, Codec):
        raise ValueError(
            f"codec={codec!r} is invalid: expected a Codec, e.g. codec_for(name) with a name in {sorted(CODECS)}"
        )
    return codec

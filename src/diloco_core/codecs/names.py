"""The codecs config can name (``[diloco] codec``), and how a name or a ``Codec`` becomes one."""

from __future__ import annotations

from .base import BF16, FP16, FP32, Codec
from .block import INT4, INT8
from .int2 import Int2Codec
from .sign import SignCodec

__all__ = ["CODECS", "INT2", "SIGN", "check_codec", "codec_for"]

SIGN = SignCodec("sign")
INT2 = Int2Codec("int2")

CODECS: dict[str, Codec] = {c.name: c for c in (FP32, FP16, BF16, INT8, INT4, INT2, SIGN)}
"""The codecs config can name (block codecs with the default block of 256 values)."""


def codec_for(name: str | Codec, block: int = 256) -> Codec:
    """The codec called ``name`` (a ``Codec`` is returned as is); a block codec with ``block`` values per scale."""
    if isinstance(name, Codec):
        return name
    try:
        codec = CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"codec={name!r} is invalid: expected one of {sorted(CODECS)}") from None
    return codec if type(block) is int and block == codec.block else codec.with_block(block)


def check_codec(codec: object) -> Codec:
    """``codec`` if it is a ``Codec``; a clear ``ValueError`` otherwise (a transport's input check)."""
    if not isinstance(codec, Codec):
        raise ValueError(
            f"codec={codec!r} is invalid: expected a Codec, e.g. codec_for(name) with a name in {sorted(CODECS)}"
        )
    return codec

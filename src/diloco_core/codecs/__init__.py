"""The codecs: how pseudo-gradients travel on the wire (``base.Codec``), by name (``names``)."""

from .base import Codec, CodecId
from .block import INT4, INT8, BlockCodec
from .cast import BF16, FP16, FP32, CastCodec
from .names import CODECS, SIGN, check_codec, codec_for
from .sign import SignCodec
from .wire import mean_of_payloads, reference_mean

__all__ = [
    "BF16",
    "CODECS",
    "FP16",
    "FP32",
    "INT4",
    "INT8",
    "SIGN",
    "BlockCodec",
    "CastCodec",
    "Codec",
    "CodecId",
    "SignCodec",
    "check_codec",
    "codec_for",
    "mean_of_payloads",
    "reference_mean",
]

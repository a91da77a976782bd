"""The run's state as a donor streams it to a peer that takes it (hivemind's ``rpc_download_state``,
overridden in the averager's process).

hivemind serializes each tensor whole before its first byte leaves (``.numpy().tobytes()``, that
copied into its message, every 64 KiB part copied out again by ``split_for_streaming``: three
copies of a 150M model's 0.6 GB, about 1.5 s on the averager's one thread while the donor trains
on the same cores) and sends 64 KiB a message. Here an uncompressed tensor of a plain dtype
(``incoming.DIRECT``) goes as slices of its own bytes, each copied once as it is sent,
``PART_BYTES`` a message. The messages are hivemind's (``runtime_pb2.Tensor``: the first with the
dtype, shape, compression and number of parts), so hivemind's reader and ``incoming.Incoming``
read them alike; anything else is sent as hivemind sends it.
"""

from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from hivemind.compression import CompressionInfo, NoCompression
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from .incoming import DIRECT

__all__ = ["PART_BYTES", "Serving", "parts_of"]

PART_BYTES = 2**19
"""Bytes per message: the payload exchange's part size (``averager``'s ``part_size_bytes``)."""


def parts_of(tensor: torch.Tensor, *, size: int = PART_BYTES) -> Iterator[runtime_pb2.Tensor]:
    """An uncompressed tensor of a plain dtype as the messages of a download, ``size`` bytes
    each."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
    yield runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE,
        buffer=raw[:size].tobytes(),
        chunks=len(range(0, len(raw), size)),
        size=tensor.shape,
        dtype=str(tensor.dtype).removeprefix("torch."),
        requires_grad=tensor.requires_grad,
    )
    for at in range(size, len(raw), size):
        yield runtime_pb2.Tensor(buffer=raw[at : at + size].tobytes())


class Serving:
    """Needs hivemind's ``allow_state_sharing``, ``state_compression`` and the private
    ``_get_current_state_from_host_process``."""

    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: Any
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not self.allow_state_sharing:
            return  # the peer asks the next donor
        metadata, tensors, infos = await self._get_current_state_from_host_process()
        direct = isinstance(self.state_compression, NoCompression)
        for i, tensor in enumerate(tensors):
            if direct and str(tensor.dtype).removeprefix("torch.") in DIRECT:
                parts = parts_of(tensor)
            else:
                info = infos[i] if infos is not None else CompressionInfo.from_tensor(tensor, key=i)
                parts = split_for_streaming(self.state_compression.compress(tensor, info))
            for part in parts:
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                metadata = None

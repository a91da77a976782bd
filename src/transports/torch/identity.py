"""Collective identity on the torch transport: no reduce is ever paired with another rank's different one.

torch.distributed pairs collectives by their order on each rank, nothing else. A rank that called one
reduce more or less than the others (a retry after a timeout, a straggler whose late call arrives after
the others gave up) would pair every later reduce with the wrong one, and the means would be silently
wrong from then on. So every reduce first all-gathers a small header, [key, its sequence number on this
rank, values, the codec's identity and path, the bytes it sends each peer], and starts its payload only once every rank's header matched; a mismatch is a clear
``TransportError`` naming both sides, raised within the header's exchange, not after a timeout.

The bytes are what this rank's codec gives for the values (``payload_size``): a rank whose codec declares
the same identity but ships payloads of another size (a setting its identity does not carry) is refused,
named, before any payload moves. gloo cannot refuse the payload itself: a longer one than the receiver
posted aborts the receiving process (gloo's ``op.preamble.length <= op.nbytes``), a shorter one completes
and leaves the rest of the buffer as it was (both measured, ``tests/test_payload_sizes.py``); so a rank
running altered transport code, which states one size and sends another, is out of its reach.

A reduce that fails or times out leaves the group unusable: its collectives may still be posted on some
ranks, so any later one could pair with them. Every later call raises at once, saying that the group must
be formed again (under torchrun: ``--max-restarts`` restarts the workers, ``--resume`` continues).
"""

from __future__ import annotations

import zlib
from collections import Counter

import torch

from diloco_core import CODECS, Codec
from diloco_core.codecs.base import CodecId
from diloco_core.transport import TransportError

from .wire_bytes import Path

__all__ = ["Identity"]

FIELDS = 5


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


# every codec identity a rank may send (older layouts too) on each path, so that a mismatch names the other rank's
_BLOCKS = [2**k for k in range(4, 17)]
_WIRES = {
    _crc(f"{w} by {path}"): f"{w} by {path}"
    for c in CODECS.values()
    for b in ([1] if c.block == 1 else _BLOCKS)
    for w in (CodecId(c.name, b, v) for v in range(1, c.layout + 1))
    for path in (p.value for p in Path)
}


class Identity:
    """One rank's count of reduces per key, the headers it sends, and the group's broken state."""

    def __init__(self) -> None:
        self._seq: Counter[str] = Counter()
        self._names: dict[int, str] = dict(_WIRES)
        self.broken: str | None = None

    def check_usable(self) -> None:
        if self.broken is not None:
            raise TransportError(
                f"this torch.distributed group is unusable since {self.broken}: a collective may still be posted on "
                "some ranks, so no later one can be paired safely; form the group again (under torchrun: "
                "--max-restarts restarts the workers and --resume continues from the last checkpoint)"
            )

    def header(
        self, key: str, codec: Codec, numel: int, device: torch.device, *, path: Path, each: int
    ) -> torch.Tensor:
        """The next reduce of ``key``: [key, its number on this rank (1 for the first), values, codec identity
        and the ``path`` it takes, the bytes ``each`` peer gets from this rank]."""
        self._seq[key] += 1
        wire = f"{codec.identity} by {path.value}"
        self._names[_crc(key)], self._names[_crc(wire)] = key, wire
        fields = [_crc(key), self._seq[key], numel, _crc(wire), each]
        return torch.tensor(fields, dtype=torch.int64, device=device)

    def _describe(self, row: list[int]) -> str:
        key, seq, numel, wire, _ = row  # its bytes: named where only they differ (``check``)
        # a key this rank never used
        name = repr(self._names[key]) if key in self._names else f"key {key:#x}"
        return f"{name} #{seq} ({numel} values, {self._names.get(wire, 'another wire')})"

    def check(self, gathered: torch.Tensor, rank: int) -> None:
        """Raise ``TransportError`` (and mark the group broken) unless every rank's header is this rank's."""
        rows = gathered.view(-1, FIELDS).tolist()
        mine = rows[rank]
        other = next((r for r, row in enumerate(rows) if row != mine), None)
        if other is not None and rows[other][:-1] == mine[:-1]:
            self.broken = f"rank {other}'s payloads were not its codec's size"
            raise TransportError(
                f"rank {other}'s payload is refused: {rows[other][-1]} bytes to each peer, expected "
                f"{mine[-1]} (this rank's, rank {rank}, at reduce {self._describe(mine)}): the same "
                "codec identity with other settings; refused before any payload moved"
            )
        if other is not None:
            self.broken = "a reduce met a different one on another rank"
            raise TransportError(
                f"collective mismatch: rank {other} is at reduce {self._describe(rows[other])}, this rank (rank {rank}) "
                f"at {self._describe(mine)}; never paired (a rank retried or gave up a reduce the others did not, "
                "or the ranks run different settings)"
            )

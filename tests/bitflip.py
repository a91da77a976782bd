"""One flipped bit inside a tensor's bytes of a ``torch.save`` file, as a bad disk or copy would leave it."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path


def flip_bit(path: Path) -> str:
    """Flip the lowest bit of the middle byte of the largest tensor's bytes in ``path`` (its ``data/N`` entry
    of the zip archive; stored, not compressed, so its bytes sit as they are in the file). The zip's own
    CRC of the entry is left as it was: ``torch.load`` does not check it. The entry's name."""
    with zipfile.ZipFile(path) as z:
        entries = [i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl")]
        entry = max(entries, key=lambda i: i.file_size)
    assert entry.compress_type == zipfile.ZIP_STORED and entry.file_size > 0
    with path.open("r+b") as f:
        f.seek(entry.header_offset)
        header = f.read(30)  # the local file header: its name and extra field lengths at bytes 26-29
        assert header[:4] == b"PK\x03\x04"
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        at = entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))
    return entry.filename

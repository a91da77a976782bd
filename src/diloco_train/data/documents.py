"""The corpus's documents, read lazily: files of a folder or of the standard library, JSONL records, 1 KiB blocks.

A document is ``(name, tokens)``: bytes (vocab 256) or a 1-D int32 array of a tokenizer's ids. Its name alone
decides whether it is a validation document (a SHA-256 of it) and where it goes in the training stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

__all__ = ["Document", "Source", "digest", "is_val", "local_source", "stdlib_root", "stdlib_source"]

Document = tuple[str, bytes | np.ndarray]
Source = tuple[Iterator[Document], int, list]
"""The documents (read as they are iterated), the vocabulary size, and a stamp that changes with the files."""

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")
# Test suites would make up 60% of the standard library's bytes; site-packages is not the stdlib.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_BLOCK_BYTES = 1024


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def is_val(name: str, fraction: float) -> bool:
    return int.from_bytes(digest(name)[:8], "big") < fraction * 2**64


def stamp_of(files: Sequence[Path]) -> list:
    """What changes when one of ``files`` does: their paths, sizes and modification times."""
    return [[str(p), (s := p.stat()).st_size, s.st_mtime_ns] for p in files]


def stdlib_source(root: Path) -> Source:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        files.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    docs = ((p.relative_to(root).as_posix(), p.read_bytes()) for p in files)
    return docs, 256, stamp_of(files)


def _jsonl_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    with path.open("rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
            except UnicodeDecodeError as e:  # JSON is UTF-8 text
                raise ValueError(
                    f"{path}:{i + 1}: not UTF-8 text (byte {e.object[e.start]:#04x})"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{path}:{i + 1}: expected an object with a string {text_field!r} field"
                )
            yield f"{name}:{i + 1}", record[text_field].encode()


def _file_documents(path: Path, name: str, text_field: str, whole_file: bool) -> Iterator[Document]:
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, name, text_field)
    elif whole_file:
        yield name, path.read_bytes()
    else:  # a lone text file has no document boundaries: blocks are the unit of the split
        with path.open("rb") as f:
            for i, block in enumerate(iter(lambda: f.read(_BLOCK_BYTES), b"")):
                yield f"{name}#{i}", block


def local_source(path: str, text_field: str) -> Source:
    """The documents of ``data.path``: a file (JSONL records or 1 KiB blocks), or a folder's text files."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"data.path={path!r} does not exist")
    if root.is_file():
        return _file_documents(root, root.name, text_field, whole_file=False), 256, stamp_of([root])
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"data.path={path!r} holds no {', '.join(TEXT_SUFFIXES)} files")
    docs = (
        d
        for p in files
        for d in _file_documents(p, p.relative_to(root).as_posix(), text_field, whole_file=True)
    )
    return docs, 256, stamp_of(files)

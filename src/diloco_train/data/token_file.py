"""Token files (``data.streaming``): a corpus tokenized once onto disk and read through a memory map.

The file holds the training tokens then the validation tokens, in the same order as the in-memory corpus
(training documents by a hash of their names, validation documents by name), so the same seed draws the same
batches. It is written in two passes that never hold the corpus: the documents as they are read into a
scratch file, then copied in their final order. Each is written under a temporary name and renamed, and the
``.json`` that describes it last: a file there is complete. Its name is a hash of the data settings and of the
source files' sizes and times, so a changed file is tokenized again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .documents import Document, digest, is_val

__all__ = ["LazyNames", "TokenFile", "cache_folder", "open_or_build"]

VERSION = 1
_CHUNK = 1 << 22


def cache_folder(token_cache: str) -> Path:
    if token_cache:
        return Path(token_cache).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "diloco", "tokens")


class LazyNames(Sequence[str]):
    """Document names ``start`` .. ``stop`` of a names file (one JSON string a line), read when first asked for."""

    def __init__(self, path: Path, start: int, stop: int) -> None:
        self.path = path
        self.start = start
        self.stop = stop
        self.names: list[str] | None = None

    def _all(self) -> list[str]:
        if self.names is None:
            with self.path.open() as f:
                lines = f.readlines()[self.start : self.stop]
            self.names = [json.loads(line) for line in lines]
        return self.names

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._all()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())


@dataclass(frozen=True)
class TokenFile:
    train: torch.Tensor
    val: torch.Tensor
    train_names: LazyNames
    val_names: LazyNames


def _open(base: Path, meta: dict) -> TokenFile:
    dtype = np.dtype(meta["dtype"])
    n_train, n_val = meta["train_tokens"], meta["val_tokens"]
    # Copy-on-write: a writable array torch takes without a warning; nothing ever writes to it.
    tokens = torch.from_numpy(
        np.memmap(base.with_suffix(".tokens"), dtype=dtype, mode="c", shape=(n_train + n_val,))
    )
    names, docs = base.with_suffix(".names"), meta["train_documents"]
    return TokenFile(
        train=tokens[:n_train],
        val=tokens[n_train:],
        train_names=LazyNames(names, 0, docs),
        val_names=LazyNames(names, docs, docs + meta["val_documents"]),
    )


def _scratch(base: Path, what: str) -> Path:
    return base.with_name(f"{base.name}.{os.getpid()}-{threading.get_ident()}.{what}.tmp")


class _Index:
    """Per document of the scratch files, in reading order: where its tokens and its name are, its name's hash."""

    def __init__(self) -> None:
        self.offset = array("q")
        self.length = array("q")
        self.name_at = array("q")
        self.hi = array("Q")
        self.lo = array("Q")
        self.val = array("b")

    def add(self, *, offset: int, length: int, name_at: int, name: str, val: bool) -> None:
        d = digest(name)
        self.offset.append(offset)
        self.length.append(length)
        self.name_at.append(name_at)
        self.hi.append(int.from_bytes(d[:8], "big"))
        self.lo.append(int.from_bytes(d[8:16], "big"))
        self.val.append(val)


def _scan(
    docs: Iterable[Document], *, tokens: Path, names: Path, dtype: np.dtype, val_fraction: float
) -> _Index:
    index = _Index()
    at = 0
    name_at = 0
    with tokens.open("wb", buffering=_CHUNK) as t, names.open("wb", buffering=_CHUNK) as n:
        for name, doc in docs:
            if not len(doc):
                continue
            raw = (
                doc if isinstance(doc, bytes) else np.ascontiguousarray(doc, dtype=dtype).tobytes()
            )
            line = (json.dumps(name) + "\n").encode()
            t.write(raw)
            n.write(line)
            index.add(
                offset=at,
                length=len(raw),
                name_at=name_at,
                name=name,
                val=is_val(name, val_fraction),
            )
            at, name_at = at + len(raw), name_at + len(line)
    return index


def _order(index: _Index, names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(training documents by name hash, validation documents by name): the in-memory corpus's order."""
    val = np.frombuffer(index.val, dtype=np.int8).astype(bool)
    by_hash = np.lexsort(
        (np.frombuffer(index.lo, dtype=np.uint64), np.frombuffer(index.hi, dtype=np.uint64))
    )
    # a small corpus may draw no validation document at all: hold out the first by hash
    if not val.any():
        val[by_hash[0]] = True
    train = by_hash[~val[by_hash]]
    if not len(train):
        raise ValueError(
            f"data: all {len(val)} documents fell into validation; lower data.val_fraction"
        )
    held = np.flatnonzero(val)
    held = held[np.argsort([_name(names, index, int(i)) for i in held], kind="stable")]
    return train, held


def _name(names: np.ndarray, index: _Index, i: int) -> str:
    end = index.name_at[i + 1] if i + 1 < len(index.name_at) else len(names)
    return json.loads(bytes(names[index.name_at[i] : end]))


def _copy(order: np.ndarray, *, source: np.ndarray, index: _Index, out) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for i in order.tolist():
        out.write(source[index.offset[i] : index.offset[i] + index.length[i]])
        total += index.length[i]
    return total


def _build(docs: Iterable[Document], *, base: Path, dtype: np.dtype, val_fraction: float) -> dict:
    scratch, scratch_names = _scratch(base, "scan"), _scratch(base, "scan-names")
    tokens, names = _scratch(base, "tokens"), _scratch(base, "names")
    try:
        index = _scan(
            docs, tokens=scratch, names=scratch_names, dtype=dtype, val_fraction=val_fraction
        )
        if len(index.offset) < 2:
            raise ValueError(
                f"data: {len(index.offset)} non-empty document(s) found; need at least 2 to hold one out"
            )
        source = np.memmap(scratch, dtype=np.uint8, mode="r")
        name_bytes = np.memmap(scratch_names, dtype=np.uint8, mode="r")
        train, val = _order(index, name_bytes)
        with tokens.open("wb", buffering=_CHUNK) as out:
            n_train = _copy(train, source=source, index=index, out=out)
            n_val = _copy(val, source=source, index=index, out=out)
        with names.open("wb", buffering=_CHUNK) as out:
            for i in [*train.tolist(), *val.tolist()]:
                end = index.name_at[i + 1] if i + 1 < len(index.name_at) else len(name_bytes)
                out.write(name_bytes[index.name_at[i] : end])
        del source, name_bytes
        os.replace(tokens, base.with_suffix(".tokens"))
        os.replace(names, base.with_suffix(".names"))
        meta = {
            "version": VERSION,
            "dtype": dtype.name,
            "train_tokens": n_train // dtype.itemsize,
            "val_tokens": n_val // dtype.itemsize,
            "train_documents": len(train),
            "val_documents": len(val),
        }
        described = _scratch(base, "json")
        described.write_text(json.dumps(meta))
        os.replace(described, base.with_suffix(".json"))
        return meta
    finally:
        for p in (scratch, scratch_names, tokens, names):
            p.unlink(missing_ok=True)


def open_or_build(
    docs: Iterable[Document], *, folder: Path, key: object, dtype: np.dtype, val_fraction: float
) -> TokenFile:
    """The token file of ``key`` in ``folder``: opened where a complete one is there, else built from ``docs``."""
    name = hashlib.sha256(
        json.dumps([VERSION, key], sort_keys=True, default=str).encode()
    ).hexdigest()[:32]
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / name
    described = base.with_suffix(".json")
    if described.exists():
        meta = json.loads(described.read_text())
        size = (meta["train_tokens"] + meta["val_tokens"]) * np.dtype(meta["dtype"]).itemsize
        tokens = base.with_suffix(".tokens")
        # else a file deleted or cut short: written again
        if tokens.exists() and tokens.stat().st_size == size:
            return _open(base, meta)
    return _open(base, _build(docs, base=base, dtype=dtype, val_fraction=val_fraction))

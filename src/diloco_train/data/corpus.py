"""Training data: documents split into train/validation by a hash of their name, byte tokens, worker shards.

With no path configured the corpus is the running interpreter's own standard library (*.py files,
about 12 MB), so that the default run needs no download. A document is a file (folder or standard
library), a record (JSONL), or a 1 KiB block (a single plain text file); each goes wholly to train or
to validation, so no validation byte is ever trained on. ``data.streaming`` reads the same tokens from a
memory-mapped token file instead of memory (token_file.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from diloco_core.rules import boolean, check_field, check_fields, integer, number, string

from .documents import Document, Source, digest, is_val, local_source, stdlib_root, stdlib_source
from .token_file import cache_folder, open_or_build

__all__ = ["BatchSampler", "Corpus", "DataConfig", "load_corpus", "stdlib_root"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str = field(default="", metadata=string())
    """A text/JSONL file or a folder of them (.txt .md .py .rst .jsonl). Empty: the interpreter's stdlib source."""
    text_field: str = field(default="text", metadata=string())
    """Field holding the text in JSONL records."""
    val_fraction: float = field(default=0.05, metadata=number(gt=0, lt=1))
    """Share of documents held out for validation, chosen by a hash of each document's name."""
    seq_len: int = field(default=64, metadata=integer(low=1))
    """Tokens per training window (each window reads seq_len + 1 tokens)."""
    hf_dataset: str = field(default="", metadata=string())
    """Hugging Face dataset name or local path (needs ``pip install 'diloco[hf]'``); replaces ``path``."""
    hf_split: str = field(default="train", metadata=string())
    """Split of ``hf_dataset`` to read."""
    hf_tokenizer: str = field(default="", metadata=string())
    """Hugging Face tokenizer for ``hf_dataset``; empty: bytes (vocab 256)."""
    max_documents: int = field(default=0, metadata=integer(low=0))
    """Read at most this many documents of ``hf_dataset`` (0: all)."""
    streaming: bool = field(default=False, metadata=boolean())
    """Tokenize once into a token file in ``token_cache`` and read it memory-mapped: for corpora larger than
    memory. The same tokens, in the same order, as without: the same batches."""
    token_cache: str = field(default="", metadata=string())
    """Folder of the token files of ``streaming``; empty: $XDG_CACHE_HOME/diloco/tokens (~/.cache/diloco/tokens)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_field(
            "path", self.path, not (self.path and self.hf_dataset), "empty when hf_dataset is set"
        )
        # Settings of hf_dataset alone: without it they were ignored silently (data.path trains on bytes).
        alone = (
            "empty without hf_dataset (it applies to hf_dataset only; data.path is read as bytes)"
        )
        check_field(
            "hf_tokenizer", self.hf_tokenizer, bool(self.hf_dataset or not self.hf_tokenizer), alone
        )
        ok = bool(self.hf_dataset or not self.max_documents)
        check_field("max_documents", self.max_documents, ok, alone.replace("empty", "0"))
        ok = bool(self.hf_dataset or self.hf_split == "train")
        check_field("hf_split", self.hf_split, ok, alone.replace("empty", "'train' (the default)"))
        ok = bool(self.path or self.hf_dataset or self.text_field == "text")
        check_field(
            "text_field",
            self.text_field,
            ok,
            "'text' (the default) without data.path or hf_dataset",
        )
        ok = bool(self.streaming or not self.token_cache)
        check_field(
            "token_cache",
            self.token_cache,
            ok,
            "empty without data.streaming=true (it holds its files)",
        )


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor
    """All training tokens, documents concatenated in the order of a hash of their names (1-D; uint8 for
    bytes, int32 otherwise)."""
    val: torch.Tensor
    """All validation tokens, likewise."""
    vocab_size: int
    train_names: Sequence[str]
    """Names of the training documents, in that order (data.streaming: read from its file when first asked)."""
    val_names: Sequence[str]

    def shard(self, rank: int, world_size: int) -> torch.Tensor:
        """Worker ``rank``'s own contiguous slice of the training tokens; slices of different ranks never overlap."""
        assert 0 <= rank < world_size
        n = self.train.numel()
        return self.train[rank * n // world_size : (rank + 1) * n // world_size]


def _source(config: DataConfig) -> Source:
    if config.hf_dataset:
        # datasets and transformers are imported only where asked for
        from .data_hf import (
            hf_source,
        )

        return hf_source(config)
    if config.path:
        return local_source(config.path, config.text_field)
    return stdlib_source(stdlib_root())


def _concat(docs: list[Document]) -> torch.Tensor:
    if isinstance(docs[0][1], bytes):
        return torch.frombuffer(bytearray(b"".join(d for _, d in docs)), dtype=torch.uint8)  # type: ignore[arg-type]
    return torch.from_numpy(np.concatenate([np.asarray(d, dtype=np.int32) for _, d in docs]))


def _in_memory(docs: Iterable[Document], *, vocab: int, val_fraction: float) -> Corpus:
    docs = [d for d in docs if len(d[1])]
    if len(docs) < 2:
        raise ValueError(
            f"data: {len(docs)} non-empty document(s) found; need at least 2 to hold one out"
        )
    docs.sort(key=lambda d: d[0])
    val = [d for d in docs if is_val(d[0], val_fraction)]
    if not val:  # a small corpus may draw no validation document at all: hold out the first by hash
        val = [min(docs, key=lambda d: digest(d[0]))]
    val_names = {n for n, _ in val}
    # Training documents in hash order: a worker's contiguous shard is then a random mix of files,
    # as in the paper's i.i.d. setting, not one corner of the library (e.g. only email/ and json/).
    train = [d for d in docs if d[0] not in val_names]
    train.sort(key=lambda d: digest(d[0]))
    if not train:
        raise ValueError(
            f"data: all {len(docs)} documents fell into validation; lower data.val_fraction"
        )
    return Corpus(
        train=_concat(train),
        val=_concat(val),
        vocab_size=vocab,
        train_names=tuple(n for n, _ in train),
        val_names=tuple(n for n, _ in val),
    )


_cache: dict[DataConfig, Corpus] = {}
_cache_lock = threading.Lock()


def load_corpus(config: DataConfig) -> Corpus:
    """Read, split and tokenize the corpus ``config`` names (cached per config within the process)."""
    with _cache_lock:
        if config in _cache:
            return _cache[config]
        docs, vocab, stamp = _source(config)
        if config.streaming:
            where = (
                str(Path(config.path).expanduser().resolve()) if config.path else str(stdlib_root())
            )
            key = [where, config.hf_dataset, config.hf_split, config.hf_tokenizer]
            key += [config.text_field, config.max_documents, config.val_fraction, stamp]
            folder = cache_folder(config.token_cache)
            # bytes, or a tokenizer's ids
            dtype = np.dtype(np.int32 if config.hf_tokenizer else np.uint8)
            found = open_or_build(
                docs, folder=folder, key=key, dtype=dtype, val_fraction=config.val_fraction
            )
            corpus = Corpus(
                train=found.train,
                val=found.val,
                vocab_size=vocab,
                train_names=found.train_names,
                val_names=found.val_names,
            )
        else:
            corpus = _in_memory(docs, vocab=vocab, val_fraction=config.val_fraction)
        logger.info(
            "corpus: %d train documents (%d tokens), %d validation (%d tokens)",
            len(corpus.train_names),
            corpus.train.numel(),
            len(corpus.val_names),
            corpus.val.numel(),
        )
        _cache[config] = corpus
        return corpus


class BatchSampler:
    """Random contiguous windows of ``seq_len + 1`` tokens drawn with a seeded generator.

    The generator is the whole data position: saving its state (a uint8 tensor) and restoring it
    makes the next batches identical to those an uninterrupted run would have drawn.
    """

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, what: str = "data"
    ) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"{what} has {tokens.numel()} tokens, fewer than one window of data.seq_len + 1 = {seq_len + 1}; "
                "use more data or a smaller data.seq_len"
            )
        if batch_size > tokens.numel() - seq_len:
            raise ValueError(
                f"train.batch_size={batch_size} is larger than the {tokens.numel() - seq_len} distinct windows "
                f"in {what} ({tokens.numel()} tokens); use more data or a smaller batch"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len) int64."""
        starts = torch.randint(
            0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=self.generator
        )
        window = self.tokens[starts[:, None] + self._offsets].long()
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])

"""Training data: documents split into train/validation by a hash of their name, byte tokens, worker shards.

With no path configured the corpus is the running interpreter's own standard library (*.py files,
about 12 MB), so that the default run needs no download. A document is a file (folder or standard
library), a record (JSONL), or a 1 KiB block (a single plain text file); each goes wholly to train or
to validation, so no validation byte is ever trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco_core.config import check_field, check_fields, integer, number, string

__all__ = ["BatchSampler", "Corpus", "DataConfig", "load_corpus", "stdlib_root"]

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")
# Test suites would make up 60% of the standard library's bytes; site-packages is not the stdlib.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_BLOCK_BYTES = 1024


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
    """Hugging Face dataset name or local path (needs ``pip install diloco[hf]``); replaces ``path``."""
    hf_split: str = field(default="train", metadata=string())
    """Split of ``hf_dataset`` to read."""
    hf_tokenizer: str = field(default="", metadata=string())
    """Hugging Face tokenizer for ``hf_dataset``; empty: bytes (vocab 256)."""
    max_documents: int = field(default=0, metadata=integer(low=0))
    """Read at most this many documents of ``hf_dataset`` (0: all)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_field("path", self.path, not (self.path and self.hf_dataset), "empty when hf_dataset is set")
        # Settings of hf_dataset alone: without it they were ignored silently (data.path trains on bytes).
        alone = "empty without hf_dataset (it applies to hf_dataset only; data.path is read as bytes)"
        check_field("hf_tokenizer", self.hf_tokenizer, bool(self.hf_dataset or not self.hf_tokenizer), alone)
        ok = bool(self.hf_dataset or not self.max_documents)
        check_field("max_documents", self.max_documents, ok, alone.replace("empty", "0"))


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor
    """All training tokens, documents concatenated in the order of a hash of their names (1-D; uint8 for
    bytes, int32 otherwise)."""
    val: torch.Tensor
    """All validation tokens, likewise."""
    vocab_size: int
    train_names: tuple[str, ...]
    val_names: tuple[str, ...]

    def shard(self, rank: int, world_size: int) -> torch.Tensor:
        """Worker ``rank``'s own contiguous slice of the training tokens; slices of different ranks never overlap."""
        assert 0 <= rank < world_size
        n = self.train.numel()
        return self.train[rank * n // world_size : (rank + 1) * n // world_size]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_val(name: str, fraction: float) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def _stdlib_documents(root: Path) -> list[tuple[str, bytes]]:
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                p = Path(dirpath, f)
                docs.append((p.relative_to(root).as_posix(), p.read_bytes()))
    return docs


def _file_documents(path: Path, name: str, text_field: str, whole_file: bool) -> list[tuple[str, bytes]]:
    raw = path.read_bytes()
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(raw.splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{i + 1}: expected an object with a string {text_field!r} field")
            docs.append((f"{name}:{i + 1}", record[text_field].encode()))
        return docs
    if whole_file:
        return [(name, raw)]
    # A lone text file has no document boundaries: blocks are the unit of the split.
    return [(f"{name}#{i}", raw[o : o + _BLOCK_BYTES]) for i, o in enumerate(range(0, len(raw), _BLOCK_BYTES))]


def _local_documents(config: DataConfig) -> list[tuple[str, bytes]]:
    root = Path(config.path).expanduser()
    if not root.exists():
        raise ValueError(f"data.path={config.path!r} does not exist")
    if root.is_file():
        return _file_documents(root, root.name, config.text_field, whole_file=False)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"data.path={config.path!r} holds no {', '.join(TEXT_SUFFIXES)} files")
    docs = []
    for p in files:
        docs.extend(_file_documents(p, p.relative_to(root).as_posix(), config.text_field, whole_file=True))
    return docs


def _hf_documents(config: DataConfig) -> tuple[list[tuple[str, list[int] | bytes]], int]:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise ValueError("data.hf_dataset needs Hugging Face datasets: pip install 'diloco[hf]'") from None
    from datasets import load_dataset

    ds = load_dataset(config.hf_dataset, split=config.hf_split)
    if config.max_documents:
        ds = ds.select(range(min(config.max_documents, len(ds))))
    if config.text_field not in ds.column_names:
        raise ValueError(
            f"data.text_field={config.text_field!r} is not a column of {config.hf_dataset}: {ds.column_names}"
        )
    texts = ds[config.text_field]
    names = [f"{config.hf_dataset}:{config.hf_split}:{i}" for i in range(len(texts))]
    if not config.hf_tokenizer:
        return [(n, t.encode()) for n, t in zip(names, texts)], 256
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("data.hf_tokenizer needs transformers: pip install 'diloco[hf]'") from None
    tok = AutoTokenizer.from_pretrained(config.hf_tokenizer)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return [(n, list(i) + eos) for n, i in zip(names, ids)], len(tok)


def _concat(docs: list[tuple[str, list[int] | bytes]], vocab_size: int) -> torch.Tensor:
    if vocab_size <= 256:
        return torch.frombuffer(bytearray(b"".join(d for _, d in docs)), dtype=torch.uint8)  # type: ignore[arg-type]
    flat = [t for _, d in docs for t in d]
    return torch.tensor(flat, dtype=torch.int32)


_cache: dict[DataConfig, Corpus] = {}
_cache_lock = threading.Lock()


def load_corpus(config: DataConfig) -> Corpus:
    """Read, split and tokenize the corpus ``config`` names (cached per config within the process)."""
    with _cache_lock:
        if config in _cache:
            return _cache[config]
        if config.hf_dataset:
            docs, vocab = _hf_documents(config)
        elif config.path:
            docs, vocab = _local_documents(config), 256
        else:
            docs, vocab = _stdlib_documents(stdlib_root()), 256
        docs = [d for d in docs if len(d[1])]
        if len(docs) < 2:
            raise ValueError(f"data: {len(docs)} non-empty document(s) found; need at least 2 to hold one out")
        docs.sort(key=lambda d: d[0])
        val = [d for d in docs if _is_val(d[0], config.val_fraction)]
        if not val:  # a small corpus may draw no validation document at all: hold out the first by hash
            val = [min(docs, key=lambda d: hashlib.sha256(d[0].encode()).digest())]
        val_names = {n for n, _ in val}
        # Training documents in hash order: a worker's contiguous shard is then a random mix of files,
        # as in the paper's i.i.d. setting, not one corner of the library (e.g. only email/ and json/).
        train = [d for d in docs if d[0] not in val_names]
        train.sort(key=lambda d: hashlib.sha256(d[0].encode()).digest())
        if not train:
            raise ValueError(f"data: all {len(docs)} documents fell into validation; lower data.val_fraction")
        corpus = Corpus(
            train=_concat(train, vocab),
            val=_concat(val, vocab),
            vocab_size=vocab,
            train_names=tuple(n for n, _ in train),
            val_names=tuple(n for n, _ in val),
        )
        logger.info(
            "corpus: %d train documents (%d tokens), %d validation (%d tokens)",
            len(train),
            corpus.train.numel(),
            len(val),
            corpus.val.numel(),
        )
        _cache[config] = corpus
        return corpus


class BatchSampler:
    """Random contiguous windows of ``seq_len + 1`` tokens drawn with a seeded generator.

    The generator is the whole data position: saving its state (a uint8 tensor) and restoring it
    makes the next batches identical to those an uninterrupted run would have drawn.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, what: str = "data") -> None:
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
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=self.generator)
        window = self.tokens[starts[:, None] + self._offsets].long()
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])

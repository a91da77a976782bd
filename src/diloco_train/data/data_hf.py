"""Hugging Face data (``data.hf_dataset``, ``data.hf_tokenizer``; needs ``pip install 'diloco[hf]'``).

``hf_dataset`` is a local parquet/JSONL/CSV/text file, a folder of them, a ``save_to_disk`` folder, or a hub
name. A hub name is looked up once, with a timeout, before anything downloads: where the hub cannot be
reached that is one line that suggests a local path (not a minute of retries); with ``HF_HUB_OFFLINE=1`` only
the Hugging Face cache is read. Texts are read and tokenized in batches of the memory-mapped Arrow table.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .documents import Document, Source, stamp_of

if TYPE_CHECKING:
    from .corpus import DataConfig

__all__ = ["hf_source"]

_BUILDERS = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}
_BATCH = 1000
_HUB_TIMEOUT = 10.0
_LOCAL = {
    "hf_dataset": "give a local path instead (a parquet/JSONL file, a folder of them, or a save_to_disk folder)",
    "hf_tokenizer": "give a local path instead (a folder written by the tokenizer's save_pretrained)",
}


def _looks_local(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or Path(name).suffix in _BUILDERS


def _check_hub(field: str, name: str, kind: str) -> None:
    """Fail at once, in one line, where the hub does not have ``name`` or cannot be reached."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return  # the loader reads the cache only, and fails at once where it misses (_offline)
    api = huggingface_hub.HfApi()
    info = api.dataset_info if kind == "dataset" else api.model_info
    try:
        info(name, timeout=_HUB_TIMEOUT)
    except RepositoryNotFoundError:
        raise ValueError(
            f"data.{field}={name!r} is neither a local path nor a {kind} on the Hugging Face hub"
        ) from None
    except HfHubHTTPError:
        return  # the hub answered (e.g. a gated repository): the loader says what it needs
    except Exception as e:  # noqa: BLE001 -- no network (httpx errors): the loader would retry for half a minute
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"data.{field}={name!r} is not a local path and the Hugging Face hub cannot be reached ({reason}): "
            f"{_LOCAL[field]}, or set HF_HUB_OFFLINE=1 to use a copy in the Hugging Face cache"
        ) from None


def _offline(field: str, name: str, e: Exception) -> ValueError:
    reason = (str(e).splitlines() or [type(e).__name__])[0]
    return ValueError(
        f"data.{field}={name!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set ({reason}): {_LOCAL[field]}"
    )


def _one_split(name: str, split: str, ds: Any) -> Any:
    if split != "train" and ds.split != split:
        raise ValueError(
            f"data.hf_split={split!r} is invalid: expected 'train' (the default): {name} has no splits"
        )
    return ds


def load_hf_dataset(name: str, split: str) -> Any:
    """The split ``split`` of ``name``: a local file or folder, or a hub dataset."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    path = Path(name).expanduser()
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        ds = load_from_disk(str(path))  # written by save_to_disk, which load_dataset refuses
        if not isinstance(ds, DatasetDict):
            return _one_split(name, split, ds)
        if split not in ds:
            raise ValueError(
                f"data.hf_split={split!r} is invalid: expected one of the splits of {name}: {sorted(ds)}"
            )
        return ds[split]
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise ValueError(
                f"data.hf_dataset={name!r} is invalid: expected a file ending in {', '.join(_BUILDERS)}"
            )
        return _one_split(
            name, split, load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train")
        )
    if path.is_dir():
        return load_dataset(str(path), split=split)
    if _looks_local(name):
        raise ValueError(f"data.hf_dataset={name!r} does not exist")
    _check_hub("hf_dataset", name, "dataset")
    try:
        return load_dataset(name, split=split)
    except ConnectionError as e:  # huggingface_hub's OfflineModeIsEnabled among them
        raise _offline("hf_dataset", name, e) from None


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if path.exists():
        return AutoTokenizer.from_pretrained(str(path))
    if _looks_local(name):
        raise ValueError(f"data.hf_tokenizer={name!r} does not exist")
    _check_hub("hf_tokenizer", name, "model")
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as e:  # offline and not cached
        raise _offline("hf_tokenizer", name, e) from None


def _fingerprint(tok: Any) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return hashlib.sha256(f"{type(tok).__name__} {tok.eos_token_id} {text}".encode()).hexdigest()


def _documents(config: DataConfig, ds: Any, tok: Any) -> Iterator[Document]:
    prefix = f"{config.hf_dataset}:{config.hf_split}"
    eos = [tok.eos_token_id] if tok is not None and tok.eos_token_id is not None else []
    i = 0
    for batch in ds.iter(batch_size=_BATCH):
        texts = batch[config.text_field]
        for j, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(
                    f"data.text_field={config.text_field!r}: record {i + j} of {prefix} is not text"
                )
        if tok is None:
            yield from ((f"{prefix}:{i + j}", text.encode()) for j, text in enumerate(texts))
        else:
            ids = tok(texts, add_special_tokens=False)["input_ids"]
            yield from (
                (f"{prefix}:{i + j}", np.asarray(list(d) + eos, dtype=np.int32))
                for j, d in enumerate(ids)
            )
        i += len(texts)


def hf_source(config: DataConfig) -> Source:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise ValueError(
            "data.hf_dataset needs Hugging Face datasets: pip install 'diloco[hf]'"
        ) from None
    ds = load_hf_dataset(config.hf_dataset, config.hf_split)
    if config.max_documents:
        ds = ds.select(range(min(config.max_documents, len(ds))))
    if config.text_field not in ds.column_names:
        raise ValueError(
            f"data.text_field={config.text_field!r} is not a column of {config.hf_dataset}: {ds.column_names}"
        )
    stamp: list = [stamp_of([Path(f["filename"]) for f in ds.cache_files]), len(ds)]
    if not config.hf_tokenizer:
        return _documents(config, ds, None), 256, stamp
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("data.hf_tokenizer needs transformers: pip install 'diloco[hf]'") from None
    tok = load_tokenizer(config.hf_tokenizer)
    return _documents(config, ds, tok), len(tok), [*stamp, _fingerprint(tok)]

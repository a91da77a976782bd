import itertools

"""Data: a validation set no training byte comes from, disjoint worker shards, checkpointable sampling."""

import json
from pathlib import Path

import pytest
import torch

from diloco_train.data.corpus import BatchSampler, DataConfig, load_corpus, stdlib_root


@pytest.mark.timeout(60)
def test_stdlib_corpus_split_by_file_without_leak() -> None:
    corpus = load_corpus(DataConfig())
    assert corpus.vocab_size == 256
    assert corpus.train.dtype == torch.uint8 and corpus.train.numel() > 5_000_000
    assert set(corpus.train_names).isdisjoint(corpus.val_names)
    assert 0.01 < len(corpus.val_names) / (len(corpus.train_names) + len(corpus.val_names)) < 0.15
    assert not any("site-packages" in n or n.startswith("test/") for n in corpus.train_names)
    # The validation set is exactly the held-out files, and the training stream exactly the others.
    root = stdlib_root()
    val_bytes = b"".join((root / n).read_bytes() for n in corpus.val_names)
    assert bytes(corpus.val.numpy()) == val_bytes
    train_bytes = b"".join((root / n).read_bytes() for n in corpus.train_names)
    assert bytes(corpus.train.numpy()) == train_bytes
    # Deterministic: a second load (cache bypassed) splits the same way.
    again = load_corpus(DataConfig(val_fraction=0.05 + 1e-12))
    assert again.val_names == corpus.val_names


@pytest.mark.timeout(30)
def test_folder_and_jsonl_documents_never_cross_the_split(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"doc{i}.txt").write_text(f"<doc {i}>" * 20)
    with (tmp_path / "more.jsonl").open("w") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"[rec {i}]" * 20}) + "\n")
    corpus = load_corpus(DataConfig(path=str(tmp_path), val_fraction=0.2))
    train = bytes(corpus.train.numpy()).decode()
    val = bytes(corpus.val.numpy()).decode()
    assert corpus.val_names and corpus.train_names
    for name in corpus.val_names:
        marker = f"<doc {name[3:-4]}>" if name.endswith(".txt") else f"[rec {int(name.split(':')[1]) - 1}]"
        assert marker in val and marker not in train, name


@pytest.mark.timeout(30)
def test_worker_shards_are_disjoint_and_cover_train() -> None:
    corpus = load_corpus(DataConfig())
    shards = [corpus.shard(r, 4) for r in range(4)]
    assert sum(s.numel() for s in shards) == corpus.train.numel()
    base = corpus.train.untyped_storage().data_ptr()
    spans = sorted((s.data_ptr() - base, s.data_ptr() - base + s.numel()) for s in shards)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    # Windows sampled from a shard come only from that shard.
    sampler = BatchSampler(shards[2], 16, 4, seed=0)
    x, y = sampler.next()
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.timeout(30)
def test_sampler_state_round_trip_reproduces_batches() -> None:
    tokens = torch.arange(1000, dtype=torch.int32) % 256
    a = BatchSampler(tokens, 8, 3, seed=5)
    a.next()
    state = {k: v.clone() for k, v in a.state_dict().items()}
    expected = [a.next() for _ in range(3)]
    b = BatchSampler(tokens, 8, 3, seed=99)
    b.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(expected, (b.next() for _ in range(3))):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert state["generator"].dtype == torch.uint8


@pytest.mark.timeout(30)
def test_bad_data_is_a_clear_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(DataConfig(path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_corpus(DataConfig(path=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="batch_size"):
        BatchSampler(torch.zeros(20, dtype=torch.uint8), 8, 100, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(torch.zeros(5, dtype=torch.uint8), 8, 1, seed=0)


def test_settings_of_a_hugging_face_dataset_without_one_are_refused_not_ignored(tmp_path: Path) -> None:
    """``hf_tokenizer`` next to ``data.path`` trained on bytes, silently (issue 32, friction 1)."""
    with pytest.raises(ValueError, match=r"hf_tokenizer='gpt2' is invalid: expected empty without hf_dataset"):
        DataConfig(path=str(tmp_path), hf_tokenizer="gpt2")
    with pytest.raises(ValueError, match=r"max_documents=5 is invalid: expected 0 without hf_dataset"):
        DataConfig(max_documents=5)
    with pytest.raises(ValueError, match=r"path=.* is invalid: expected empty when hf_dataset is set"):
        DataConfig(path=str(tmp_path), hf_dataset="wikitext")
    assert DataConfig(hf_dataset="wikitext", hf_tokenizer="gpt2", max_documents=5).max_documents == 5


@pytest.mark.timeout(30)
def test_data_settings_that_would_be_ignored_are_refused_in_one_line(tmp_path: Path) -> None:
    """A split, a text field or a token cache that nothing reads (issue 32: conflicting data settings)."""
    with pytest.raises(
        ValueError, match=r"^hf_split='validation' is invalid: expected 'train' \(the default\) without"
    ):
        DataConfig(path=str(tmp_path), hf_split="validation")
    with pytest.raises(ValueError, match=r"^text_field='body' is invalid: expected 'text' \(the default\) without"):
        DataConfig(text_field="body")
    with pytest.raises(ValueError, match=r"^token_cache=.* is invalid: expected empty without data.streaming=true"):
        DataConfig(token_cache=str(tmp_path))
    assert DataConfig(path=str(tmp_path), text_field="body").text_field == "body"
    assert DataConfig(hf_dataset="x", hf_split="validation", text_field="body").hf_split == "validation"
    assert DataConfig(streaming=True, token_cache=str(tmp_path)).streaming

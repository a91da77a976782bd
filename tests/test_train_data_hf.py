"""Hugging Face data with the datasets/transformers installed today (issue 32, friction 1), all built here, offline.

A tokenizer saved with ``save_pretrained`` and one dataset as a folder of parquet (where datasets 5's ``Column``
met the tokenizer: "text input must be of type str"), a parquet file, JSONL, a ``save_to_disk`` folder and a
saved ``DatasetDict``: each trains on the tokenizer's ids; a hub name that cannot be had is one line that
suggests a local path.
"""

import logging
from dataclasses import replace
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from diloco_train.data.corpus import BatchSampler, DataConfig, load_corpus

TEXTS = [f"record {i} says the {['red', 'green', 'blue'][i % 3]} fox ran {i % 7} miles" for i in range(120)]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(root / "tok")
    ds = datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))})
    ds.to_parquet(root / "d.parquet")
    (root / "parquet").mkdir()
    ds.to_parquet(root / "parquet" / "part-0.parquet")
    ds.to_json(root / "d.jsonl")
    ds.save_to_disk(root / "disk")
    datasets.DatasetDict({"train": ds.select(range(60)), "validation": ds.select(range(60, 120))}).save_to_disk(
        root / "dict"
    )
    return root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ["parquet", "d.parquet", "d.jsonl", "disk"])
def test_a_local_dataset_and_tokenizer_give_the_tokenizers_ids(made: Path, source: str) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(made / "tok")
    config = DataConfig(hf_dataset=str(made / source), hf_tokenizer=str(made / "tok"), val_fraction=0.2)
    corpus = load_corpus(config)
    assert corpus.vocab_size == len(tok) and corpus.train.dtype == torch.int32
    # Every record, tokenized and ended by EOS, is exactly one document of train or validation.
    ids = {
        f"{made / source}:train:{i}": tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for i, t in enumerate(TEXTS)
    }
    for names, tokens in ((corpus.train_names, corpus.train), (corpus.val_names, corpus.val)):
        assert tokens.tolist() == [t for n in names for t in ids[n]]
    assert sorted([*corpus.train_names, *corpus.val_names]) == sorted(ids)
    x, _ = BatchSampler(corpus.train, seq_len=8, batch_size=4, seed=0).next()
    assert x.shape == (4, 8) and int(x.max()) < corpus.vocab_size
    # Streaming: the same tokens from the token file.
    streamed = load_corpus(replace(config, streaming=True, token_cache=str(made / "cache")))
    assert torch.equal(streamed.train, corpus.train) and torch.equal(streamed.val, corpus.val)


@pytest.mark.timeout(60)
def test_a_saved_dataset_dict_reads_the_split_asked_for(made: Path) -> None:
    corpus = load_corpus(DataConfig(hf_dataset=str(made / "dict"), hf_split="validation", max_documents=30))
    text = bytes(torch.cat([corpus.train, corpus.val]).numpy()).decode()
    assert "record 60 " in text and "record 89 " in text and "record 90 " not in text and "record 59 " not in text
    with pytest.raises(ValueError, match=r"^data.hf_split='test' is invalid: expected one of the splits .*'train'"):
        load_corpus(DataConfig(hf_dataset=str(made / "dict"), hf_split="test"))
    with pytest.raises(ValueError, match=r"^data.hf_split='validation' is invalid: expected 'train'"):
        load_corpus(DataConfig(hf_dataset=str(made / "d.parquet"), hf_split="validation"))
    with pytest.raises(ValueError, match=r"^data.text_field='body' is not a column"):
        load_corpus(DataConfig(hf_dataset=str(made / "disk"), text_field="body"))
    with pytest.raises(ValueError, match=r"^data.hf_dataset='\./nowhere/x.parquet' does not exist"):
        load_corpus(DataConfig(hf_dataset="./nowhere/x.parquet"))


@pytest.mark.timeout(120)  # before: 5 retries with backoff (~25 s) per file the hub was asked for
@pytest.mark.parametrize("field", ["hf_dataset", "hf_tokenizer"])
def test_a_hub_name_that_cannot_be_had_is_one_line_suggesting_a_local_path(
    made: Path, field: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Offline (this machine, or HF_HUB_OFFLINE=1), or online with no such repository: one line, no retries."""
    name = "diloco-tests/no-such-repository-3f9c"
    settings = {"hf_dataset": name} if field == "hf_dataset" else {"hf_dataset": str(made / "disk"), field: name}
    caplog.set_level(logging.WARNING)
    with pytest.raises(ValueError) as raised:
        load_corpus(DataConfig(**settings))
    message = str(raised.value)
    assert message.startswith(f"data.{field}={name!r} ") and "\n" not in message
    assert "local path" in message
    printed = capfd.readouterr()
    assert "Retrying" not in printed.err + printed.out + caplog.text

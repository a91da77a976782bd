"""``data.streaming``: the corpus from a memory-mapped token file, the same tokens and batches as from memory.

The slow test is issue 32's acceptance check: a 50 MB generated corpus trains through the token file with a
peak resident memory less than 1 GB above the same run's on a corpus too small to count (the model, the
optimizer and the interpreter), and a stopped run resumes into the exact batches of an uninterrupted one.
"""

import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from runs import FAST, losses

from diloco_train.cli import main
from diloco_train.data.corpus import BatchSampler, DataConfig, load_corpus
from diloco_train.data.token_file import open_or_build
from diloco_train.run_config import build_config
from diloco_train.runs.resume_merge import merge_onto_saved

WORDS = [
    "the",
    "a",
    "fox",
    "dog",
    "ran",
    "over",
    "under",
    "quickly",
    "slowly",
    "red",
    "green",
    "blue",
    "river",
    "stone",
    "tree",
    "sky",
]


def _text(size: int, seed: int) -> str:
    rng = random.Random(seed)
    lines, total = [], 0
    while total < size:
        line = " ".join(rng.choices(WORDS, k=rng.randint(3, 20))) + ".\n"
        lines.append(line)
        total += len(line)
    return "".join(lines)


def _corpus(folder: Path) -> Path:
    """A single text file (1 KiB blocks) and a folder of files and JSONL records: both kinds of documents."""
    folder.mkdir()
    (folder / "big.txt").write_text(_text(300_000, 0))
    for i in range(20):
        (folder / f"doc{i}.md").write_text(_text(2_000 + 100 * i, i + 1))
    with (folder / "records.jsonl").open("w") as f:
        for i in range(50):
            f.write(json.dumps({"text": _text(500, 100 + i)}) + "\n")
    return folder


def _mapped_file(tokens: torch.Tensor) -> str:
    """The file whose memory map holds ``tokens`` ("" for anonymous memory), from /proc/self/maps."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs Linux's /proc/self/maps")
    at = tokens.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= at < high:
            return rest[4] if len(rest) == 5 and rest[4].startswith("/") else ""
    return ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["folder", "file", "stdlib"])
def test_the_token_file_holds_the_in_memory_corpus_and_draws_the_same_batches(tmp_path: Path, which: str) -> None:
    folder = _corpus(tmp_path / "data")
    path = {"folder": str(folder), "file": str(folder / "big.txt"), "stdlib": ""}[which]
    memory = load_corpus(DataConfig(path=path, val_fraction=0.1))
    streamed = load_corpus(DataConfig(path=path, val_fraction=0.1, streaming=True, token_cache=str(tmp_path / "c")))
    assert _mapped_file(streamed.train).endswith(".tokens") and _mapped_file(memory.train) == ""
    assert streamed.train.dtype == memory.train.dtype == torch.uint8
    assert torch.equal(streamed.train, memory.train) and torch.equal(streamed.val, memory.val)
    assert list(streamed.train_names) == list(memory.train_names) and list(streamed.val_names) == list(memory.val_names)
    for shard in range(3):
        a = BatchSampler(memory.shard(shard, 3), seq_len=16, batch_size=4, seed=7 + shard)
        b = BatchSampler(streamed.shard(shard, 3), seq_len=16, batch_size=4, seed=7 + shard)
        for _ in range(5):
            assert all(torch.equal(u, v) for u, v in zip(a.next(), b.next()))


@pytest.mark.timeout(60)
def test_a_token_file_is_built_once_and_again_when_its_source_changes(tmp_path: Path) -> None:
    folder = _corpus(tmp_path / "data")
    config = DataConfig(path=str(folder), streaming=True, token_cache=str(tmp_path / "c"))
    first = load_corpus(config)
    assert len(list((tmp_path / "c").glob("*.tokens"))) == 1 and not list((tmp_path / "c").glob("*.tmp"))
    # Another process (a different config object: the in-process cache missed) opens the same file, reads nothing.
    again = load_corpus(replace(config, seq_len=32))
    assert torch.equal(again.train, first.train)
    assert len(list((tmp_path / "c").glob("*.tokens"))) == 1
    (folder / "doc3.md").write_text("changed")
    changed = load_corpus(replace(config, seq_len=33))
    assert changed.train.numel() != first.train.numel() and len(list((tmp_path / "c").glob("*.tokens"))) == 2


@pytest.mark.timeout(30)
def test_token_files_go_to_the_users_cache_folder_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "small.txt").write_text(_text(20_000, 5))
    load_corpus(DataConfig(path=str(tmp_path / "small.txt"), streaming=True))
    assert len(list((tmp_path / "xdg" / "diloco" / "tokens").glob("*.tokens"))) == 1


@pytest.mark.timeout(60)
def test_a_restored_sampler_continues_the_exact_sequence_over_a_reopened_token_file(tmp_path: Path) -> None:
    docs = [(f"doc{i}", _text(3_000, i).encode()) for i in range(40)]
    built = open_or_build(iter(docs), folder=tmp_path, key="k", dtype=np.dtype(np.uint8), val_fraction=0.1)
    a = BatchSampler(built.train, seq_len=32, batch_size=8, seed=3)
    for _ in range(4):
        a.next()
    torch.save(a.state_dict(), tmp_path / "sampler.pt")
    expected = [a.next() for _ in range(6)]
    # Reopened (no document is read: an empty iterator would build an empty, refused corpus).
    reopened = open_or_build(iter(()), folder=tmp_path, key="k", dtype=np.dtype(np.uint8), val_fraction=0.1)
    b = BatchSampler(reopened.train, seq_len=32, batch_size=8, seed=999)
    b.load_state_dict(torch.load(tmp_path / "sampler.pt", weights_only=True))
    for (x1, y1), (x2, y2) in zip(expected, (b.next() for _ in range(6))):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.timeout(120)
def test_a_streamed_run_resumes_into_the_uninterrupted_runs_losses(tmp_path: Path) -> None:
    """The data order is the sampler's generator over the same tokens: the same losses as from memory, too."""
    folder = _corpus(tmp_path / "data")
    data = ["--set", f"data.path={json.dumps(str(folder))}", "--set", f"train.runs_dir={json.dumps(str(tmp_path))}"]
    stream = ["--set", "data.streaming=true", "--set", f"data.token_cache={json.dumps(str(tmp_path / 'c'))}"]
    assert main(["train", "--name", "memory", *data, *FAST]) == 0
    assert main(["train", "--name", "split", *data, *stream, *FAST, "--set", "train.stop_after=6"]) == 0
    assert len(losses(tmp_path / "split")) == 6
    assert main(["train", "--name", "split", "--resume", *data, "-q"]) == 0
    whole, split = losses(tmp_path / "memory"), losses(tmp_path / "split")
    assert len(whole) == 12 and split == whole


@pytest.mark.timeout(30)
def test_a_resume_may_switch_streaming_on_or_off_without_force(tmp_path: Path) -> None:
    saved = build_config((), ["data.seq_len=32"]).to_dict()
    cache = f"data.token_cache={json.dumps(str(tmp_path))}"
    config, lines = merge_onto_saved(saved, files=(), overrides=["data.streaming=true", cache], force=False)
    assert config.data.streaming and lines == [
        "data.streaming: False -> True",
        f"data.token_cache: '' -> {str(tmp_path)!r}",
    ]
    with pytest.raises(ValueError, match="data.seq_len"):  # what does change the data is still refused
        merge_onto_saved(saved, files=(), overrides=["data.seq_len=16"], force=False)


def _peak_rss_mb(args: list[str], env: dict[str, str]) -> float:
    """The trainer's peak resident memory (ru_maxrss of that one child, in MB)."""
    child = subprocess.Popen([sys.executable, "-m", "diloco_train.cli", *args], env=env)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, args
    return usage.ru_maxrss / 1024


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_50_mb_corpus_streams_within_1_gb_above_the_models_memory(tmp_path: Path) -> None:
    """Run as: python -m pytest -m slow tests/test_train_streaming.py -s (prints the figures)."""
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    with big.open("w") as f:
        for i in range(50):
            f.write(_text(1_000_000, i))
    small.write_text(_text(200_000, 0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = ["train", "-q", "--set", f"train.runs_dir={json.dumps(str(tmp_path / 'runs'))}"]
    run += ["--set", "train.steps=40", "--set", "diloco.inner_steps=10", "--set", "train.eval_batches=2"]
    stream = ["--set", "data.streaming=true", "--set", f"data.token_cache={json.dumps(str(tmp_path / 'c'))}"]
    model = _peak_rss_mb([*run, "--name", "small", "--set", f"data.path={json.dumps(str(small))}", *stream], env)
    on_big = [*run, "--set", f"data.path={json.dumps(str(big))}"]
    streamed = _peak_rss_mb([*on_big, "--name", "streamed", *stream], env)
    reopened = _peak_rss_mb([*on_big, "--name", "reopened", *stream], env)
    memory = _peak_rss_mb([*on_big, "--name", "memory"], env)
    print(
        f"\npeak RSS, MB: tiny corpus (the model) {model:.0f}; 50 MB corpus streamed {streamed:.0f} (tokenizing), "
        f"{reopened:.0f} (token file reused); in memory {memory:.0f}"
    )
    assert streamed - model < 1024 and reopened - model < 1024
    # The exact data order: the streamed runs and the in-memory one drew the same batches.
    runs = tmp_path / "runs"
    assert losses(runs / "streamed") == losses(runs / "reopened") == losses(runs / "memory")

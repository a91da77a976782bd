"""A checkpoint's save and load beside ``torch.save`` and ``torch.load`` of its tensors (issue 47).

Reads a checkpoint the trainer wrote (``runs/RUN/checkpoints/...pt``), then times, alternately and
``--repeats`` times each, in a temporary folder beside it (the same disk):
- ``torch.save(state, f)`` then ``torch.load(f, weights_only=True)``: the floor;
- the trainer's own: its checksum (CRC-32 of every tensor's bytes) and ``atomic_save`` (a temporary
  file, fsync, rename, fsync of the folder), then ``load_checkpoint`` (``torch.load`` and the
  checksum verified).

Each save writes a new file (as a trainer's checkpoint is), after every dirty
  page is written out (``os.sync``), so that neither save pays for the other's writeback; the page
  cache is dropped before each load where this process may (root): both loads read the disk. This
  machine's disk is noisy (a 3.6 GB save took either about 3 s or about 9 s, for either writer), so
  each line gives the median and the best of the repeats, and the ratios of both.

    python bench/checkpoint_time.py runs/p150-torch/w/checkpoints/step00000020-rank0.pt --repeats 6
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from diloco_train.runs.checkpoint import atomic_save, load_checkpoint
from diloco_train.runs.checksum import CHECKSUM, checksum_of


def _drop_cache() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    state = load_checkpoint(args.checkpoint)
    tensors = [t for t in _tensors(state)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"{args.checkpoint}: {len(tensors)} tensors, {nbytes / 1e9:.3f} GB")
    times: dict[str, list[float]] = {k: [] for k in ("torch.save", "save", "torch.load", "load")}
    with tempfile.TemporaryDirectory(dir=args.checkpoint.parent, prefix=".bench-") as folder:
        plain, ours = Path(folder) / "plain.pt", Path(folder) / "ours.pt"
        for _ in range(args.repeats):
            plain.unlink(missing_ok=True)  # a new file each time, as every checkpoint is
            os.sync()
            times["torch.save"].append(_timed(lambda: torch.save(state, plain)))
            ours.unlink(missing_ok=True)
            os.sync()
            times["save"].append(_timed(lambda: _save(state, ours)))
            _drop_cache()
            times["torch.load"].append(_timed(lambda: torch.load(plain, weights_only=True)))
            _drop_cache()
            times["load"].append(_timed(lambda: load_checkpoint(ours)))
        sizes = {"torch.save": plain.stat().st_size, "save": ours.stat().st_size}
    for k, v in times.items():
        seconds = ", ".join(f"{s:.2f}" for s in v)
        print(f"{k:>10}: {seconds} s (median {statistics.median(v):.2f}, best {min(v):.2f})")
    for ours_key, floor in (("save", "torch.save"), ("load", "torch.load")):
        ratio = statistics.median(times[ours_key]) / statistics.median(times[floor])
        best = min(times[ours_key]) / min(times[floor])
        print(f"{ours_key} / {floor}: {ratio:.2f}x (medians), {best:.2f}x (best of each)")
    gb = {k: f"{v / 1e9:.3f}" for k, v in sizes.items()}
    print(f"file sizes: torch.save {gb['torch.save']} GB, ours {gb['save']} GB")
    return 0


def _save(state: dict, path: Path) -> None:
    """The trainer's save (``rank_files``): the checksum beside the state, written atomically."""
    atomic_save({**state, CHECKSUM: checksum_of(state)}, path)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    sys.exit(main())

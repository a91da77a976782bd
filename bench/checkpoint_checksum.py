"""What the checkpoints' checksum costs: saving and loading a default ``diloco train`` checkpoint with it and
without it.

A default run (model ``tiny``, 4 in-process workers, DiLoCo) is checkpointed at step 10, with DiLoCo's
state from the first step (``train.ddp_warm_start=0``; ``--run``: an existing run folder instead); its rank 0
file (the global copy and outer momentum too) and rank 1 file are read back, then each is saved (temp file,
fsync, rename) and loaded ``--repeats`` times each way, interleaved: ``RankFiles.save`` (checksum computed)
against ``atomic_save`` of the same state (none), and ``load_checkpoint`` (checksum verified) against
``torch.load`` with the same arguments. Medians, ms.

    python bench/checkpoint_checksum.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from diloco_train.cli import main
from diloco_train.runs import checkpoint as ckpt
from diloco_train.runs.checksum import checksum_of
from diloco_train.runs.rank_files import RankFiles
from diloco_train.runs.run_folder import RunFolder


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _bench(path: Path, out: Path, repeats: int) -> dict[str, float]:
    state = ckpt.load_checkpoint(path)
    times: dict[str, list[float]] = {k: [] for k in ("save", "save+crc", "load", "load+crc", "crc alone")}
    plain, checked = out / "plain.pt", RankFiles(out, 0).checkpoint(1)
    for _ in range(repeats):
        times["save"].append(_ms(lambda: ckpt.atomic_save(state, plain)))
        times["save+crc"].append(_ms(lambda: RankFiles(out, 0).save(1, state, keep=1)))
        times["load"].append(_ms(lambda: torch.load(plain, map_location="cpu", weights_only=True)))
        times["load+crc"].append(_ms(lambda: ckpt.load_checkpoint(checked)))
        times["crc alone"].append(_ms(lambda: checksum_of(state)))
    return {k: statistics.median(v) for k, v in times.items()}


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a run folder with checkpoints (default: a fresh 10-step run)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run
        if run_dir is None:
            run_dir = Path(tmp) / "bench"
            args_train = [
                "train",
                "--name",
                "bench",
                "--set",
                f"train.runs_dir={tmp}",
                "--set",
                "train.stop_after=10",
                "--set",
                "train.ddp_warm_start=0",
            ]
            assert main([*args_train, "-q"]) == 0
        for rank in (0, 1):
            files = RunFolder(run_dir).rank(rank)
            path = files.checkpoint(files.steps()[-1])
            out = Path(tmp) / f"out{rank}"
            out.mkdir()
            ms = _bench(path, out, args.repeats)
            size = path.stat().st_size / 1e6
            print(f"rank {rank} file ({size:.1f} MB), median of {args.repeats}, ms: ", end="")
            print(", ".join(f"{k} {v:.1f}" for k, v in ms.items()))


if __name__ == "__main__":
    run()

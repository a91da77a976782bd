"""Reading a run's metrics.jsonl (the one reader), and cutting it back to the step a resume continues from.

One JSON object per line, ``type`` one of step, round, eval, summary, each with the ``step`` it belongs to;
rank 0 writes it (``report.metrics.Reporter``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .run_folder import RunFolder

__all__ = ["read_metrics", "truncate_metrics"]

logger = logging.getLogger(__name__)


def read_metrics(run_dir: str | Path, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl``. A run without the file is a ValueError, or no
    records with ``missing_ok``; a line that is not JSON (or not UTF-8) is a ValueError naming it, but
    for the last one, which a crash or a full disk can leave torn mid-write: dropped, with a warning."""
    path = RunFolder(Path(run_dir)).metrics
    if not path.is_file():
        if missing_ok:
            return []
        raise ValueError(f"{str(run_dir)!r} is not a run: no {RunFolder.METRICS} in it")
    lines = [(i, line) for i, line in enumerate(path.read_bytes().split(b"\n"), 1) if line.strip()]
    records = []
    for i, line in lines:
        try:
            records.append(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError:
            what = "UTF-8 text"
        except json.JSONDecodeError:
            what = "a JSON line"
        else:
            continue
        if i != lines[-1][0]:
            raise ValueError(f"{path}:{i} is not {what}") from None
        why = "torn by a crash or a full disk mid-write"
        logger.warning("%s:%d, its last line, is not %s (%s): dropped it", path, i, what, why)
    return records


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop what a crashed or stopped run logged after the checkpoint it resumes from."""
    path = RunFolder(run_dir).metrics
    keep = [
        r
        for r in read_metrics(run_dir, missing_ok=True)
        if r.get("type") != "summary" and r.get("step", 0) <= step
    ]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
    os.replace(tmp, path)

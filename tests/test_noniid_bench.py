"""bench/noniid.py's accounting, without training: the domains, a round's record, the tally."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from noniid import DOMAINS, Recorder, domain_of, verdicts

from diloco_core import FP32, Merge, MergeRule


def test_every_document_falls_in_one_domain_by_its_package():
    assert domain_of("encodings/cp1252.py") == "encodings"
    assert domain_of("asyncio/events.py") == "net" and domain_of("xml/dom/minidom.py") == "net"
    assert domain_of("idlelib/editor.py") == domain_of("pydoc_data/topics.py") == "tools"
    assert domain_of("os.py") == "modules" and domain_of("re/_parser.py") == "modules"
    assert list(DOMAINS) == ["encodings", "net", "tools", "modules"]  # worker r trains on the r-th


def test_a_round_record_says_who_was_left_out_and_whether_the_rule_bounded_anyone(tmp_path):
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(1000, generator=g)
    honest = [shared + torch.randn(1000, generator=g) for _ in range(3)]
    merge = Merge(rule=MergeRule.ROBUST, judged=1000)
    with Recorder(tmp_path / "merges.jsonl") as rec:
        for rows in (honest, [*honest, honest[0] * 8], [*honest, honest[0] * -1e6]):
            who = [f"rank {i}" for i in range(len(rows))]
            merge.of(rows, codec=FP32, out=torch.empty(1000), who=who)
    assert Merge.of is rec.original  # put back
    records = [json.loads(line) for line in rec.path.read_text().splitlines()]
    assert [(r["k"], r["left_out"], r["clipped"]) for r in records] == [
        (3, [], False),  # honest: the plain mean
        (4, [], True),  # x8: kept, bounded
        (4, ["rank 3"], False),  # x-1e6: left out, the others' plain mean
    ]
    norms, cosines = records[2]["norms"], records[2]["cosines"]
    assert cosines[3][0] < -0.99 and norms[3] > 1e5 * norms[0]


def test_the_tally_counts_rounds_of_every_worker_only():
    merges = [
        {"k": 4, "left_out": [], "clipped": False},
        {"k": 4, "left_out": ["rank 1"], "clipped": True},
        {"k": 4, "left_out": ["rank 1"], "clipped": False},
        {"k": 3, "left_out": ["rank 2"], "clipped": True},  # without every worker: not counted
    ]
    assert verdicts(merges, workers=4) == {
        "rounds": 3,
        "left_out_rounds": 2,
        "clipped_rounds": 1,
        "most_left_out": 2,
    }

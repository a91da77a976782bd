"""A hivemind round with 4 peers on 127.0.0.1, 25M values, fp16 and int4 wires, the default robust merge:
what no trusted owner costs (issue 44 item 2: casts merged by every member from the senders' payloads, every
relayed payload checked against its sender's digest). Run it before and after a change, on the same link:

    bench/shaped_link.sh 1gbit python -m pytest bench/test_bench_relays.py --benchmark-only
"""

from __future__ import annotations

import pytest

pytest.importorskip("hivemind")

from test_bench_hivemind import _ours

from diloco_core import Merge, MergeRule


@pytest.mark.timeout(900)
@pytest.mark.parametrize("wire", ["fp16", "int4"])
def test_four_peers(benchmark, wire):
    group = "25M values, 4 peers, robust merge, target_group_size=4"
    merge = Merge(rule=MergeRule.ROBUST)
    # a group forms once all 4 are in; a long matchmaking_time only keeps a slow starter from splitting it
    _ours(benchmark, wire, group=group, peers=4, merge=merge, target_group_size=4, matchmaking_time=10.0)

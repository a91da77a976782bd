"""Settings that differ between workers are a clear error on every rank when DiLoCo is built (issue 13, case
3: different outer_lr or momentum trained silently different replicas, a different inner_steps paired rounds
of different indices, a different wire hung until the timeout and blamed a dead peer)."""

from __future__ import annotations

import time

import pytest
import torch
from world import RankError, make_world

from diloco_core import SIGN, DiLoCo, DiLoCoConfig

pytestmark = pytest.mark.timeout(120)

BASE = {"inner_steps": 2, "outer_lr": 0.7, "reduce_timeout": 60.0}  # >= hivemind's own timeout in tests/world.py


def _build(transport, drift: dict):
    """Rank 1 builds DiLoCo with ``drift`` on top of the others' settings."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    settings = {**BASE, **(drift if transport.rank == 1 else {})}
    start = time.monotonic()
    try:
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transport, DiLoCoConfig(**settings))
    except ValueError as e:
        return "refused", str(e), time.monotonic() - start
    return "built", "", time.monotonic() - start


DRIFTS = [
    ({"outer_lr": 0.5}, "outer_lr=0.5 here vs 0.7 on rank 0", "outer_lr=0.7"),
    ({"outer_momentum": 0.9}, "outer_momentum=0.9 here vs 0.5 on rank 0", "outer_momentum=0.5"),
    ({"inner_steps": 3}, "inner_steps=3 here vs 2 on rank 0", "inner_steps=2"),
    ({"codec": "fp16"}, "codec='fp16' here vs 'fp32' on rank 0", "codec='fp32'"),
    ({"codec": "int8", "codec_block": 64}, "codec='int8b64' here vs 'fp32' on rank 0", "codec='fp32'"),
    ({"norm_clip": 4.0}, "norm_clip=4.0 here vs None on rank 0", "norm_clip=None"),
]


@pytest.mark.parametrize("kind", ["inprocess", "torch"])
def test_settings_that_differ_are_refused_on_every_rank_at_once(kind, tmp_path):
    world = make_world(kind, 3, str(tmp_path))
    try:
        for drift, here, others in DRIFTS:
            results = world.run(_build, drift, timeout=60)
            assert not any(isinstance(r, RankError) for r in results), results
            assert [r[0] for r in results] == ["refused"] * 3, (drift, results)
            assert here in results[1][1], results[1]
            for r in (results[0], results[2]):
                assert "another rank's DiLoCo settings differ from rank 0's" in r[1] and others in r[1], r
            # at once: well under the reduce_timeout (60 s) that a rank left waiting for the others would wait out
            assert max(r[2] for r in results) < BASE["reduce_timeout"] / 2
        assert [r[0] for r in world.run(_build, {}, timeout=60)] == ["built"] * 3  # the same settings: fine
    finally:
        world.close()


def test_on_hivemind_a_joiner_whose_settings_differ_refuses_itself(tmp_path):
    """Peers come and go: rank 0 is whoever holds the run's state, and the joiner that differs refuses itself."""
    world = make_world("hivemind", 2, str(tmp_path))
    try:
        drift, here, _ = DRIFTS[0]
        first, joiner = world.run(_build, drift, timeout=90)
        assert first[0] == "built" and joiner[0] == "refused" and here in joiner[1], (first, joiner)
    finally:
        world.close()


def test_the_codecs_identity_with_its_block_and_payload_layout_is_part_of_the_settings():
    """int4's nibbles changed layout (two's complement): a peer of the earlier layout is refused by the
    settings check instead of decoding garbage; the block and the layout are spelled where they matter."""
    from diloco_core.agreement import settings_of
    from transports import InProcessGroup

    def codec(wire: str):
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        d = DiLoCo(model, opt, InProcessGroup(1).transport(0), DiLoCoConfig(codec=wire))
        return settings_of(d.config, codec=d.codec, outer_lr=d.outer_lr, fragments=d.fragments)["codec"]

    assert [codec(w) for w in ("fp32", "int8", "int4")] == ["fp32", "int8b256", "int4b256v2"]
    assert codec("sign") == str(SIGN.identity) and SIGN.identity.layout == SIGN.layout

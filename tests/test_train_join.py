"""A peer that joins a run already going counts the run's steps from the state it took (issue 45, item 7).
In-process: a stand-in for hivemind's transport that loads a swarm's state at a given round, no swarm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_core import Capabilities, Membership, RunState, Transport
from diloco_train.launch import train
from diloco_train.run_config import build_config
from transports.forwarding import ForwardingTransport

pytestmark = pytest.mark.timeout(120)

SMALL = [  # 1 worker, a 1-layer model, a round every 3 steps of 12
    "train.workers=1",
    "train.steps=12",
    "diloco.inner_steps=3",
    "model.num_layers=1",
    "data.seq_len=32",
    "train.batch_size=4",
    "train.eval_batches=1",
    "train.warmup_steps=2",
    "train.checkpoint_every=1",
]


class _Joiner(ForwardingTransport, Membership):
    """Peers that come and go (as hivemind's), of which this one joins at ``round``: ``attach`` loads a state
    of that round, as a joiner loads the swarm's."""

    capabilities = Capabilities(fixed_ranks=False)

    def __init__(self, inner: Transport, *, round: int) -> None:
        super().__init__(inner)
        self.round = round

    def attach(self, state: RunState, timeout: float) -> bool:
        snapshot = state.snapshot()
        assert snapshot is not None
        meta, tensors = snapshot
        state.loader({**meta, "round": self.round}, tensors)()
        return True

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_joiner_counts_the_runs_steps_from_the_state_it_took_to_train_steps(tmp_path: Path) -> None:
    """Before: it counted from its own 0 (first step 1, 12 steps of its own, LR warmup again), so one model
    state was 6 steps apart in its log and the swarm's."""
    run = tmp_path / "late"
    config = build_config(overrides=SMALL)
    result = train(config, run, show_progress=False, wrap=lambda t: _Joiner(t, round=2))
    records = _records(run)
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert steps == list(range(7, 13)), steps  # joined at round 2 of 3 steps: step 6
    assert next(r["step"] for r in records if r["type"] == "eval") == 6  # the swarm's weights at the join
    assert [(r["step"], r["round"]) for r in records if r["type"] == "round"] == [(9, 3), (12, 4)]
    first = next(r for r in records if r["type"] == "step")
    assert first["lr"] < config.train.lr  # the schedule's rate at step 6 (cosine), not warmup's first
    assert first["lr"] > config.train.lr * config.train.min_lr_ratio
    assert (result.steps, result.steps_run, result.rounds) == (12, 6, 2)
    assert sorted(p.name for p in (run / "checkpoints").glob("*.pt")) == [
        "step00000009-rank0.pt",
        "step00000012-rank0.pt",
    ]
    print(f"joiner's first step {steps[0]}, last {steps[-1]}")


def test_a_new_run_on_a_transport_whose_peers_come_and_go_starts_at_0(tmp_path: Path) -> None:
    """The first peer (nothing to load: ``attach`` says so) starts at 0 as before."""

    class _First(_Joiner):
        def attach(self, state: RunState, timeout: float) -> bool:
            return False

    run = tmp_path / "first"
    train(build_config(overrides=SMALL), run, show_progress=False, wrap=lambda t: _First(t, round=0))
    records = _records(run)
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 13))
    assert next(r["step"] for r in records if r["type"] == "eval") == 0

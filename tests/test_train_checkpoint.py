"""Checkpoints: atomic writes, retention (and the pinned one), checksums, and loading with weights_only=True."""

import math
from pathlib import Path

import pytest
import torch
from bitflip import flip_bit

from diloco_train.runs import checkpoint as ckpt
from diloco_train.runs.rank_files import RankFiles
from diloco_train.runs.spikes import SpikeWatch


class Evil:
    """Any class: unpickling it would run arbitrary code paths, so weights_only must refuse it."""


@pytest.mark.timeout(30)
def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.pt"
    ckpt.atomic_save({"step": 1, "w": torch.ones(3)}, path)
    real_save = torch.save

    def crash(obj: object, f: object) -> None:
        real_save({"step": 2, "w": torch.zeros(1000)}, f)  # bytes reach the temp file...
        f.write(b"partial")  # type: ignore[attr-defined]
        raise KeyboardInterrupt  # ...then the process is interrupted before the rename

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_save({"step": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    state = ckpt.load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temp file left behind


@pytest.mark.timeout(30)
def test_retention_listing_and_weights_only(tmp_path: Path) -> None:
    opt_state = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1e-3).state_dict()
    for step in (10, 20, 30):
        for rank in (0, 1):
            state = {"step": step, "gen": torch.Generator().get_state(), "opt": opt_state, "names": ["a"], "x": 0.5}
            RankFiles(tmp_path, rank).save(step, state, keep=2)
    assert RankFiles(tmp_path, 0).steps() == [20, 30] == RankFiles(tmp_path, 1).steps()
    state = torch.load(RankFiles(tmp_path, 1).checkpoint(30), weights_only=True)
    assert state["step"] == 30 and state["gen"].dtype == torch.uint8


@pytest.mark.timeout(30)
def test_unsafe_or_broken_files_are_refused(tmp_path: Path) -> None:
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="cannot be read"):
        ckpt.load_checkpoint(tmp_path / "evil.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        ckpt.load_checkpoint(tmp_path / "junk.pt")


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    weights = {"embed.weight": torch.randn(64, 32, generator=g), "norm.weight": torch.ones(32, dtype=torch.bfloat16)}
    return {"format": 1, "step": step, "core": {"model": weights, "names": ["a", "b"]}, "data": {"pos": step * 7}}


@pytest.mark.timeout(30)
def test_a_flipped_bit_inside_a_weight_is_refused_in_one_line(tmp_path: Path) -> None:
    """Before: the file loaded, one weight changed, and nothing said so (torch.load checks no CRC)."""
    path = RankFiles(tmp_path, 0).save(3, _state(3), keep=2)
    assert ckpt.load_checkpoint(path)["core"]["model"]["embed.weight"].equal(_state(3)["core"]["model"]["embed.weight"])
    flip_bit(path)
    flipped = torch.load(path, weights_only=True)["core"]["model"]["embed.weight"]  # torch itself loads it
    assert (flipped != _state(3)["core"]["model"]["embed.weight"]).sum() == 1 and torch.isfinite(flipped).all()
    with pytest.raises(ValueError) as e:
        ckpt.load_checkpoint(path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"checkpoint {str(path)!r} cannot be read: its checksum crc32:")
    assert "the file changed after it was written" in line


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["data"].update(pos=s["data"]["pos"] + 1),  # a plain value beside the tensors
        lambda s: s["core"]["model"].update({"norm.weight": torch.ones(2, 16, dtype=torch.bfloat16)}),  # a shape
        lambda s: s["core"]["names"].reverse(),  # an order
    ],
)
def test_the_checksum_covers_values_shapes_and_order(change: object) -> None:
    from diloco_train.runs.checksum import checksum_of

    state = _state(3)
    before = checksum_of(state)
    assert checksum_of(_state(3)) == before and checksum_of({**state, "checksum": "crc32:0"}) == before
    change(state)  # type: ignore[operator]
    assert checksum_of(state) != before


@pytest.mark.timeout(30)
def test_a_checkpoint_without_a_checksum_still_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Written by a version before checksums: refusing it would strand the run."""
    path = RankFiles(tmp_path, 0).checkpoint(3)
    ckpt.atomic_save(_state(3), path)
    with caplog.at_level("WARNING"):
        assert ckpt.load_checkpoint(path)["data"] == {"pos": 21}
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {str(path)!r} has no checksum (written before checksums): loaded unverified"
    ]


@pytest.mark.timeout(30)
def test_rotation_keeps_the_pinned_checkpoint(tmp_path: Path) -> None:
    for step in (3, 6, 9, 12, 15):
        RankFiles(tmp_path, 0).save(step, _state(step), keep=2)
        if step == 6:
            RankFiles(tmp_path, 0).pin(3, why="a test")
    assert RankFiles(tmp_path, 0).steps() == [3, 12, 15]
    RankFiles(tmp_path, 0).pin(12, why="a later spike")  # a new pin replaces the old one
    RankFiles(tmp_path, 0).save(18, _state(18), keep=2)
    assert RankFiles(tmp_path, 0).steps() == [12, 15, 18]
    assert RankFiles(tmp_path, 1).pinned() is None
    said = "the newest checkpoint is of step 18; the newest before a loss spike is of step 12"
    assert RankFiles(tmp_path, 0).newest() == said  # what a run that diverges says


def _spike_run(folder: Path, losses: dict[int, float], checkpoints: tuple[int, ...]) -> SpikeWatch:
    for step in checkpoints:
        RankFiles(folder, 0).save(step, _state(step), keep=100)
    watch = SpikeWatch(RankFiles(folder, 0))
    for step, loss in sorted(losses.items()):
        watch.see(step, loss)
    return watch


@pytest.mark.timeout(30)
def test_a_spike_pins_the_newest_checkpoint_whose_next_loss_was_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loss of step 10 is the first on the state of step 9's checkpoint: that one is not pinned, 6 is."""
    losses = {s: 4.0 - 0.01 * s for s in range(1, 10)} | {10: 400.0, 11: 380.0, 12: math.nan, 13: 390.0}
    with caplog.at_level("WARNING"):
        watch = _spike_run(tmp_path, losses, checkpoints=(3, 6, 9))
    assert RankFiles(tmp_path, 0).pinned() == 6 and watch.first == 10
    line = (
        "step 10: loss 400 is a spike (101x the median 3.95 before it): the checkpoint of step 6, the newest "
        f"before it, is kept out of rotation ({tmp_path / 'pinned-rank0.json'})"
    )
    assert [r.getMessage() for r in caplog.records] == [line]  # one per spike: 11 and 13 are of it, NaN neither


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ({s: 4.0 for s in range(1, 13)} | {9: 7.9, 11: 7.0}, None),  # under 2x the median: none
        ({s: 0.3 for s in range(1, 13)} | {11: 1.2}, None),  # 4x, but 0.9 nats: batch noise near 0
        ({s: 4.0 for s in range(1, 8)} | {8: 40.0}, None),  # 7 losses seen: too few to judge
        ({s: 4.0 for s in range(1, 20)} | {10: 40.0, 11: 4.0, 17: 9.0}, 15),  # recovered, then a new spike
    ],
)
def test_what_is_a_spike(tmp_path: Path, losses: dict[int, float], expected: int | None) -> None:
    _spike_run(tmp_path, losses, checkpoints=(3, 6, 9, 12, 15, 16))
    assert RankFiles(tmp_path, 0).pinned() == expected

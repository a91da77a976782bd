"""Checkpoints: atomic writes, retention, and loading with weights_only=True."""

from pathlib import Path

import pytest
import torch

from diloco_train import checkpoint as ckpt


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
            ckpt.save_checkpoint(tmp_path, step, rank, state, keep=2)
    assert ckpt.list_checkpoints(tmp_path, 0) == [20, 30] == ckpt.list_checkpoints(tmp_path, 1)
    state = torch.load(ckpt.checkpoint_path(tmp_path, 30, 1), weights_only=True)
    assert state["step"] == 30 and state["gen"].dtype == torch.uint8


@pytest.mark.timeout(30)
def test_unsafe_or_broken_files_are_refused(tmp_path: Path) -> None:
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="cannot be read"):
        ckpt.load_checkpoint(tmp_path / "evil.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        ckpt.load_checkpoint(tmp_path / "junk.pt")

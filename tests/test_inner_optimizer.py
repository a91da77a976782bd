"""train.inner_optimizer: AdamW as it always was; Muon for the blocks' matrices, AdamW for the rest, as one optimizer."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from diloco_core.guard import reset_if_nonfinite
from diloco_train.inner_optimizer import MuonAdamW, build_inner_optimizer
from diloco_train.model import Llama, ModelConfig
from diloco_train.schedule import set_lr
from diloco_train.train_config import TrainConfig

SHAPE = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
MUON = TrainConfig(inner_optimizer="muon", lr=3e-3, muon_lr=0.03)
SCALE = MUON.muon_lr / MUON.lr


def _model() -> Llama:
    return Llama(SHAPE, torch.Generator().manual_seed(0))


def _train(model: Llama, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """Steps on batches of their own seed, each under its own learning rate (as the schedule sets it)."""
    for step in steps:
        set_lr(optimizer, 1e-3 * (1 + step % 3))
        x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(step))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_adamw_is_torchs_adamw_with_the_groups_it_always_had() -> None:
    model, t = _model(), TrainConfig()
    optimizer = build_inner_optimizer(model, t)
    assert type(optimizer) is torch.optim.AdamW
    params = list(model.parameters())
    assert [g["params"] for g in optimizer.param_groups] == [
        [p for p in params if p.ndim >= 2],
        [p for p in params if p.ndim < 2],
    ]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [t.weight_decay, 0.0]
    assert optimizer.defaults["betas"] == (t.beta1, t.beta2) and optimizer.defaults["lr"] == t.lr
    set_lr(optimizer, 0.1 + 0.2)
    assert all(g["lr"] == 0.1 + 0.2 for g in optimizer.param_groups)  # the schedule's lr, exactly


def test_muon_takes_the_blocks_matrices_and_adamw_the_embedding_head_and_norms() -> None:
    model = _model()
    optimizer = build_inner_optimizer(model, MUON)
    assert isinstance(optimizer, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in optimizer.muon.param_groups for p in g["params"])
    assert muon == sorted(
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.q", "attn.kv", "attn.o", "mlp.gate_up", "mlp.down")
    )
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in optimizer.adamw.param_groups)
    assert decay == ["embed.weight", "lm_head.weight"] and all(n.endswith("norm.weight") for n in no_decay)
    assert len(muon) + len(decay) + len(no_decay) == len(names)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [MUON.weight_decay / SCALE, MUON.weight_decay, 0.0]
    set_lr(optimizer, MUON.lr)  # the schedule's peak: muon_lr for Muon's matrices, lr for the rest
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([MUON.muon_lr, MUON.lr, MUON.lr], rel=1e-15)


def test_a_step_is_torchs_muon_and_adamw_each_stepping_its_parameters() -> None:
    ours, theirs = _model(), _model()
    _train(ours, build_inner_optimizer(ours, MUON), range(3))
    hidden = [p for p in theirs.blocks.parameters() if p.ndim == 2]
    rest = [p for p in theirs.parameters() if all(p is not h for h in hidden)]
    pair = [
        torch.optim.Muon(hidden, weight_decay=MUON.weight_decay / SCALE),  # its lr: SCALE x AdamW's, below
        torch.optim.AdamW(
            [
                {"params": [p for p in rest if p.ndim >= 2], "weight_decay": MUON.weight_decay},
                {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=MUON.lr,
            betas=(MUON.beta1, MUON.beta2),
        ),
    ]
    for step in range(3):
        for o, scale in zip(pair, (SCALE, 1.0)):
            for group in o.param_groups:
                group["lr"] = 1e-3 * (1 + step % 3) * scale
        x = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(step))
        torch.nn.functional.cross_entropy(theirs(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        for o in pair:
            o.step()
            o.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(), _model().parameters()))


def test_the_groups_lr_reaches_both_optimizers() -> None:
    model = _model()
    optimizer = build_inner_optimizer(model, MUON)
    before = copy.deepcopy(list(model.parameters()))
    set_lr(optimizer, 0.0)  # no step, no decay: nothing moves
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert len(optimizer.state) == len(before)  # yet every parameter's state was made


def test_a_saved_and_loaded_state_continues_exactly_and_its_state_is_one_dict() -> None:
    whole, split = _model(), _model()
    _train(whole, build_inner_optimizer(whole, MUON), range(6))
    first = build_inner_optimizer(split, MUON)
    _train(split, first, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    resumed = build_inner_optimizer(split, MUON)  # as a resumed worker builds it, then loads the checkpoint
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    _train(split, resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), split.parameters()))
    # DiLoCo's guard restarts a diverged worker's optimizer through ``state``: both optimizers, after a load too
    next(iter(resumed.muon.state.values()))["momentum_buffer"].fill_(float("nan"))
    reset_if_nonfinite(resumed, round=1)
    assert not resumed.state and not resumed.muon.state and not resumed.adamw.state


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"inner_optimizer": "sgd"}, "inner_optimizer='sgd' is invalid: expected one of ['adamw', 'muon']"),
        ({"inner_optimizer": "muon", "fsdp_shards": 2}, "expected adamw with fsdp_shards=2"),
    ],
)
def test_an_unknown_optimizer_or_muon_on_fsdp_shards_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TrainConfig(**fields)

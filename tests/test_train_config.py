"""Config: TOML sections to dataclasses, unknown keys and wrong types rejected, --set parsing."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

from diloco_core import Capabilities
from diloco_train.modes import ddp_wire, warm_start_steps
from diloco_train.run_config import build_config, dump_toml, load_toml, parse_override


@pytest.mark.timeout(30)
def test_defaults_and_trainer_defaults() -> None:
    c = build_config()
    assert c.train.mode == "diloco" and c.train.workers == 4 and c.model.preset == "tiny"
    assert c.diloco.inner_steps == 10 and c.diloco.outer_lr is None and c.diloco.outer_momentum == 0.5
    assert c.diloco.codec == "int4" and c.diloco.error_feedback and c.train.ddp_wire_dtype is None
    assert c.diloco.nesterov and c.train.ddp_warm_start is None  # a twelfth of the steps (modes.warm_start_steps)
    assert "outer_lr" not in c.to_dict()["diloco"]  # unset stays unset in a run's config.toml: the rule decides
    assert c.transport == {"kind": "inprocess"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("overrides", "wire"),
    [
        ([], "int4"),  # the warm start on the rounds' codec
        (["train.mode=ddp"], "fp32"),  # the DDP baseline stays exact
        (["diloco.codec=fp32"], "fp32"),
        (["diloco.codec=sign"], "int4"),  # sign gradients lost 3.4%: not the warm start's default
        (["diloco.codec=int2"], "int4"),  # as coarse as sign
        (["diloco.codec=sign", "train.ddp_wire_dtype=sign"], "sign"),  # named: as named
        (["diloco.codec=topk"], "int4"),  # sparse gradients each step: unmeasured, not the warm start's default
        (["train.mode=ddp", "train.ddp_wire_dtype=int8"], "int8"),
    ],
)
def test_ddp_gradients_travel_fp32_in_ddp_mode_and_on_the_rounds_codec_in_a_warm_start(overrides, wire) -> None:
    config = build_config(overrides=overrides)
    assert ddp_wire(config) == wire
    assert "ddp_wire_dtype" not in config.to_dict()["train"] or overrides[-1].startswith("train.ddp_wire_dtype")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.ddp_warm_start=-1"], "ddp_warm_start=-1 is invalid: expected an integer >= 0"),
        (["train.ddp_warm_start=600"], "a step count below steps=600"),
        (["train.mode=ddp", "train.ddp_warm_start=5"], "in diloco mode"),
    ],
)
def test_bad_warm_start_names_the_field_and_the_range(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="ddp_warm_start") as e:
        build_config(overrides=overrides)
    assert message in str(e.value)


@pytest.mark.timeout(30)
def test_a_bad_ddp_wire_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"ddp_wire_dtype='int3' is invalid: expected one of \['bf16'"):
        build_config(overrides=["train.ddp_wire_dtype=int3"])
    with pytest.raises(
        ValueError, match=r"warm_start_sync='weights' is invalid: expected one of \['gradients', 'updates'\]"
    ):
        build_config(overrides=["train.warm_start_sync=weights"])
    with pytest.raises(ValueError, match=r"ddp_error_feedback=1 is invalid: expected true or false"):
        build_config(overrides=["train.ddp_error_feedback=1"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("overrides", "fixed_ranks", "warm"),
    [
        ([], True, 50),  # the default run: 600 steps
        (["train.steps=11"], True, 0),
        ([], False, 0),  # peers come and go (hivemind): no DDP phase a joiner could not take part in
        (["train.ddp_warm_start=7"], False, 7),
        (["train.ddp_warm_start=0"], True, 0),
        (["train.fsdp_shards=2"], True, 0),  # FSDP islands: no DDP phase
    ],
)
def test_the_default_warm_start_is_a_twelfth_of_the_steps_where_ranks_are_fixed(
    overrides: list[str], fixed_ranks: bool, warm: int
) -> None:
    assert warm_start_steps(build_config(overrides=overrides), fixed_ranks=fixed_ranks) == warm


@pytest.mark.timeout(30)
def test_toml_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[train]\nsteps = 10\nmode = "ddp"\n[diloco]\nouter_lr = 0.5\n[model]\nnum_layers = 2\n')
    c = build_config([f], ["train.steps=20", "data.seq_len=96", "diloco.codec=fp16", "train.bf16=false"])
    assert (c.train.steps, c.train.mode, c.diloco.outer_lr, c.model.num_layers) == (20, "ddp", 0.5, 2)
    assert c.data.seq_len == 96 and c.diloco.codec == "fp16" and c.train.bf16 is False


@pytest.mark.timeout(30)
def test_the_deprecated_wire_dtype_key_still_sets_the_codec_with_one_deprecation_warning(tmp_path: Path) -> None:
    f = tmp_path / "old.toml"
    f.write_text('[diloco]\nwire_dtype = "sign"\n')
    for files, overrides, codec in [([f], [], "sign"), ([], ["diloco.wire_dtype=fp16"], "fp16")]:
        with pytest.warns(DeprecationWarning, match=f"use codec='{codec}'") as caught:
            c = build_config(files, overrides)
        assert len(caught) == 1 and c.diloco.codec == codec  # over the trainer's default codec, int4
        assert "wire_dtype" not in c.to_dict()["diloco"] and c.to_dict()["diloco"]["codec"] == codec
    with pytest.warns(DeprecationWarning):  # renamed within its layer: a later layer's codec wins
        assert build_config([f], ["diloco.codec=int8"]).diloco.codec == "int8"
    with pytest.raises(ValueError, match=r"wire_dtype='int3' is invalid"):
        build_config([], ["diloco.wire_dtype=int3"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['wire'\].*valid keys: \[(?!.*wire_dtype)"):
        build_config([], ["diloco.wire=int8"])  # the alias is accepted, not advertised


@pytest.mark.timeout(30)
def test_parse_override_values() -> None:
    assert parse_override("train.lr=3e-4") == ("train", "lr", 3e-4)
    assert parse_override("train.mode=ddp") == ("train", "mode", "ddp")
    assert parse_override('data.path="a b.txt"') == ("data", "path", "a b.txt")
    assert parse_override('transport.peers=["x", "y"]') == ("transport", "peers", ["x", "y"])
    assert parse_override("data.path=/tmp/x=y") == ("data", "path", "/tmp/x=y")
    for bad in ("train", "train.steps", "steps=3", "train.a.b=1"):
        with pytest.raises(ValueError, match="section.key=value"):
            parse_override(bad)
    with pytest.raises(ValueError, match=r"valid sections: \['model', 'data', 'train', 'diloco', 'transport'\]"):
        parse_override("trian.steps=3")


@pytest.mark.timeout(30)
def test_unknown_key_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stpes'\] in \[train\]; valid keys: \[.*'steps'"):
        build_config(overrides=["train.stpes=3"])
    f = tmp_path / "bad.toml"
    f.write_text("[diloco]\nH = 5\n")
    with pytest.raises(ValueError, match=r"valid keys: \['inner_steps'"):
        build_config([f])
    f.write_text("[optimizer]\nlr = 5\n")
    with pytest.raises(ValueError, match="unknown section"):
        build_config([f])
    with pytest.raises(
        ValueError, match="valid keys: \\['kind', 'quorum', 'grace_seconds', 'link_latency_ms', 'link_mbit'\\]"
    ):
        build_config(overrides=["transport.world_size=2"])


@pytest.mark.timeout(30)
def test_wrong_types_and_ranges_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[train\] steps='many' is invalid"):
        build_config(overrides=["train.steps=many"])
    with pytest.raises(ValueError, match=r"\[train\] lr=-1 is invalid"):
        build_config(overrides=["train.lr=-1"])
    with pytest.raises(ValueError, match=r"\[diloco\] inner_steps=1.5"):
        build_config(overrides=["diloco.inner_steps=1.5"])
    with pytest.raises(ValueError, match="mode"):
        build_config(overrides=["train.mode=fsdp"])
    with pytest.raises(ValueError, match=r"shard=1 is invalid: expected below num_shards=0"):
        build_config(overrides=["train.shard=1"])
    with pytest.raises(ValueError, match="kind"):
        build_config(overrides=["transport.kind=carrier-pigeon"])
    with pytest.raises(ValueError, match="does not exist"):
        build_config([tmp_path / "missing.toml"])
    (tmp_path / "broken.toml").write_text("[train\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        build_config([tmp_path / "broken.toml"])


@pytest.mark.timeout(30)
def test_saved_config_round_trips(tmp_path: Path) -> None:
    c = build_config(overrides=["train.lr=1e-5", "data.path=some/where", "train.stop_after=5", "model.num_layers=3"])
    text = dump_toml(c.to_dict())
    assert "stop_after" not in text  # one invocation's setting, not the run's
    again = build_config(base=tomllib.loads(text))
    assert again == replace(c, train=replace(c.train, stop_after=0))
    f = tmp_path / "c.toml"
    f.write_text(text)
    assert load_toml(f) == tomllib.loads(text)


@pytest.mark.timeout(30)
def test_toml_text_reads_back_unchanged_and_has_no_null() -> None:
    tables = {"s": {"f": -0.0, "inf": float("inf"), "t": 'a"b\\c\né', "list": ("x", 2), "yes": True}}
    back = tomllib.loads(dump_toml(tables))
    assert back == {"s": {"f": -0.0, "inf": float("inf"), "t": 'a"b\\c\né', "list": ["x", 2], "yes": True}}
    assert str(back["s"]["f"]) == "-0.0"
    with pytest.raises(ValueError, match="cannot write to TOML"):
        dump_toml({"s": {"unset": None}})  # TOML has no null: RunConfig.to_dict leaves unset values out


@pytest.mark.timeout(30)
def test_a_warm_start_that_averages_updates_is_refused_where_peers_come_and_go() -> None:
    import torch

    from diloco_train.model import Llama
    from diloco_train.modes import Sync

    config = build_config(overrides=["train.ddp_warm_start=5", "train.warm_start_sync=updates", "model.num_layers=1"])
    model = Llama(config.model)
    swarm = SimpleNamespace(capabilities=Capabilities(fixed_ranks=False))  # refused before anything is sent
    with pytest.raises(ValueError, match=r"warm_start_sync='updates' is invalid on a transport whose peers come"):
        Sync(config=config, model=model, optimizer=torch.optim.AdamW(model.parameters()), transport=swarm, device="cpu")


def test_the_warm_start_that_averages_updates_is_every_step_plain_averaging_whatever_the_rounds_settings():
    """``DiLoCoConfig.every_step``: the settings that shape a round are the plain average's; the rest stay."""
    from diloco_core import DiLoCoConfig

    rounds = DiLoCoConfig(inner_steps=8, overlap="streaming", fragments=2, overlap_steps=1, merge_alpha=0.5)
    elastic = DiLoCoConfig(inner_steps=8, round_seconds=2.0, rda=True, outer_lr=0.7, reduce_timeout=9.0)
    for c in (rounds, elastic):
        plain = c.every_step(codec="int4", error_feedback=False)
        assert (plain.inner_steps, plain.round_seconds, plain.overlap, plain.fragments) == (1, None, "none", 1)
        assert (plain.outer_lr, plain.outer_momentum, plain.rda, plain.merge_alpha) == (1.0, 0.0, False, 0.0)
        assert (plain.codec, plain.error_feedback) == ("int4", False)
        assert (plain.reduce_timeout, plain.round_retries, plain.merge) == (c.reduce_timeout, c.round_retries, c.merge)

"""The model a run produces: evals of the global weights at round boundaries, and ``diloco export`` loaded back
(ours and through transformers) giving the run's final eval loss."""

import json
import os
from pathlib import Path

import pytest
import torch
from runs import FAST, losses

from diloco_train.cli import main
from diloco_train.compute import evaluate
from diloco_train.data.corpus import load_corpus
from diloco_train.export import global_state, load
from diloco_train.hf_llama import write_hf
from diloco_train.model import Llama, ModelConfig
from diloco_train.run_config import build_config, load_toml

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # from_pretrained of a local folder: never the hub

# 13 steps with a round every 3: the last round ends at step 12, step 13 is one unsynced inner step after it.
ODD = [*FAST, "--set", "train.steps=13"]


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


class _Logits(torch.nn.Module):
    """A transformers causal LM as ``evaluate`` calls a model: tokens in, logits out."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(tokens).logits


@pytest.mark.timeout(60)
def test_evals_come_at_round_boundaries_when_eval_every_is_not_a_multiple_of_h(tmp_path: Path) -> None:
    run = ["train", "--set", f"train.runs_dir={tmp_path!s}", *ODD]
    assert main([*run, "--name", "r", "--set", "train.eval_every=2"]) == 0
    # Asked for at 2, 4, ...: each comes at the round boundary at or after it; the last at the end of the run.
    evals = _records(tmp_path / "r", "eval")
    assert [r["step"] for r in evals] == [0, 3, 6, 9, 12, 13]
    # Step 13 is one unsynced inner step after the last round: its eval is of the same global weights.
    assert evals[-1]["loss"] == evals[-2]["loss"]
    # An eval swaps the global weights in and the worker's own back: fewer evals, the same trajectory. (eager:
    # a worker's weights differ from the global copy at round boundaries too, by its fresh share.)
    for name, every in [("e2", 2), ("e6", 6)]:
        assert main([*run, "--name", name, "--set", "diloco.overlap=eager", "--set", f"train.eval_every={every}"]) == 0
    assert [r["step"] for r in _records(tmp_path / "e6", "eval")] == [0, 6, 12, 13]
    assert losses(tmp_path / "e6") == losses(tmp_path / "e2")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", ["none", "eager", "streaming"])
def test_an_export_loads_back_with_the_final_eval_loss_ours_and_through_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overlap: str
) -> None:
    extra = ["--set", f"diloco.overlap={overlap}"]
    if overlap == "streaming":  # 2 fragments of one block each, each reduce behind 1 inner step
        extra += ["--set", "model.num_layers=2", "--set", "diloco.fragments=2", "--set", "diloco.overlap_steps=1"]
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *ODD, *extra]) == 0
    run = tmp_path / "r"
    final = _records(run, "summary")[-1]["eval_after"]
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "exported step 13" in capsys.readouterr().out

    config = build_config((), (), base=load_toml(run / "config.toml"))
    val, cpu = load_corpus(config.data).val, torch.device("cpu")
    model = load(tmp_path / "out")
    assert evaluate(model, val=val, config=config, device=cpu) == pytest.approx(final, rel=1e-6)
    if overlap == "none":  # the global copy, not rank 0's replica after its last (unsynced) step
        saved = torch.load(run / "checkpoints" / "step00000013-rank0.pt", weights_only=True)["core"]["model"]
        assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), saved))

    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    assert evaluate(_Logits(hf), val=val, config=config, device=cpu) == pytest.approx(final, rel=1e-5)


@pytest.mark.timeout(60)
def test_the_hugging_face_llama_computes_our_logits_with_grouped_kv_heads_and_our_rope_and_eps(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    c = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=500.0, norm_eps=1e-3)
    c = c.resolved(vocab_size=256)
    ours = Llama(c, generator=torch.Generator().manual_seed(1)).eval()
    with torch.no_grad():  # norms away from 1, so that a norm mapped wrongly shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    write_hf(tmp_path, c, dict(ours.named_parameters()), max_positions=48)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
def test_export_refuses_what_it_cannot_export_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"diloco: error: {str(tmp_path)!r} is not a run folder: it has no config.toml (e.g. runs/diloco-...)\n"
    )
    common = ["--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", *common, "--set", "train.stop_after=5", "--set", "train.checkpoint_every=0"]) == 0
    with pytest.raises(ValueError, match=r"--step 3 is invalid: expected one of the run's checkpoints, steps \[5\]"):
        global_state(tmp_path / "r", step=3)
    capsys.readouterr()
    (tmp_path / "r" / "checkpoints" / "step00000005-rank0.pt").unlink()
    (tmp_path / "r" / "checkpoints" / "step00000005-rank1.pt").unlink()
    assert main(["export", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no checkpoint yet: nothing to export" in err


@pytest.mark.timeout(60)
def test_a_runs_hugging_face_tokenizer_is_saved_beside_the_hf_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    word_level = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(word_level)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    made = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    made.save_pretrained(tmp_path / "tok")
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 0
    # The run as one trained on a dataset with that tokenizer records it (only [data] is read by export).
    config = (tmp_path / "r" / "config.toml").read_text()
    config = config.replace('hf_dataset = ""', 'hf_dataset = "corpus"')
    (tmp_path / "r" / "config.toml").write_text(config.replace('hf_tokenizer = ""', f'hf_tokenizer = "{tmp_path}/tok"'))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "r")]) == 0
    assert f"tokenizer: '{tmp_path}/tok', copied to hf/" in capsys.readouterr().out
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "r" / "export" / "hf")
    assert back("hello world again").input_ids == [1, 2, 0]
    meta = json.loads((tmp_path / "r" / "export" / "config.json").read_text())
    assert meta["tokenizer"]["name"] == f"{tmp_path}/tok" and meta["step"] == 12

"""Model presets and the decoder's basic behaviour."""

import pytest
import torch

from diloco_train.model import PRESETS, Llama, ModelConfig, count_parameters


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("preset", "expected"), [("tiny", 1.0e6), ("150m", 150e6), ("1b", 1.1e9)])
def test_preset_parameter_counts_on_meta_device(preset: str, expected: float) -> None:
    n = count_parameters(ModelConfig(preset=preset))
    assert abs(n - expected) / expected < 0.10, f"{preset}: {n:,} parameters"


@pytest.mark.timeout(30)
def test_big_presets_have_a_32000_vocab_and_tiny_bytes() -> None:
    assert PRESETS["150m"]["vocab_size"] == PRESETS["1b"]["vocab_size"] == 32000
    assert PRESETS["tiny"]["vocab_size"] == 256


@pytest.mark.timeout(30)
def test_forward_shape_causality_and_seeded_init() -> None:
    config = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    a = Llama(config, torch.Generator().manual_seed(0))
    b = Llama(config, torch.Generator().manual_seed(0))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    x = torch.randint(0, 256, (2, 10))
    logits = a(x)
    assert logits.shape == (2, 10, 256)
    # Changing a later token must not change the logits of earlier positions.
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 256
    torch.testing.assert_close(a(y)[:, :7], logits[:, :7])
    assert not torch.allclose(a(y)[:, 7:], logits[:, 7:])


@pytest.mark.timeout(30)
def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="preset"):
        ModelConfig(preset="huge")
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(hidden_size=130, num_heads=4)
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig(num_layers=0)
    assert ModelConfig().resolved(vocab_size=300).vocab_size == 300  # unset: the tokenizer's vocabulary...
    assert ModelConfig().resolved().vocab_size == 256  # ...else the preset's
    assert ModelConfig(vocab_size=512).resolved(vocab_size=300).vocab_size == 512
    assert ModelConfig(preset="150m").resolved().hidden_size == 768

"""Our Llama as a Hugging Face ``LlamaForCausalLM`` folder: its config.json and its weights under HF's names.

The two models compute the same function, so the mapping is a renaming and two splits, no numerics:

- rotary embeddings rotate (first half, second half) pairs of each head (HF's ``rotate_half``), with
  frequencies ``1 / theta ** (2i / head_dim)`` at positions 0, 1, ...: ``rope_theta``, default rope type;
- RMSNorm in fp32 with ``norm_eps`` (``rms_norm_eps``), then the weight (``x / rms * w``, no ``1 + w``);
- our fused ``attn.kv`` projection is keys then values (``view(..., 2, kv_heads, head_dim)``): its first
  ``kv_heads * head_dim`` rows are ``k_proj``, the rest ``v_proj``; grouped-query heads repeat each kv head
  for ``num_heads // kv_heads`` consecutive query heads (``repeat_interleave``, HF's ``repeat_kv``);
- our fused ``mlp.gate_up`` is gate then up (``silu(gate) * up``): ``gate_proj``, ``up_proj``;
- no biases; untied embeddings (``lm_head`` has its own weight); attention scaled by ``1 / sqrt(head_dim)``.

tests/test_export.py checks that both models give the same logits (GQA included) and the same eval loss.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .model import ModelConfig

__all__ = ["hf_config", "hf_state_dict", "write_hf"]

_LAYER = re.compile(r"^blocks\.(\d+)\.(.+)$")
_SAME = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_config(c: ModelConfig, *, max_positions: int) -> dict[str, object]:
    """``LlamaForCausalLM``'s config.json for our resolved model config ``c``; ``max_positions``: the sequence
    length trained on (rotary embeddings go further, untrained)."""
    assert c.hidden_size and c.num_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.hidden_size // c.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},  # transformers 5.x
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": c.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def hf_state_dict(c: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters ``state`` (``Llama.named_parameters()``' names) under ``LlamaForCausalLM``'s names."""
    assert c.hidden_size and c.num_heads and c.num_kv_heads
    kv_rows = c.num_kv_heads * (c.hidden_size // c.num_heads)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        m = _LAYER.match(name)
        if m is None:
            raise ValueError(f"parameter {name!r} has no Hugging Face Llama counterpart")
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest in _SAME:
            out[prefix + _SAME[rest]] = t
        elif rest == "attn.kv.weight":
            out[prefix + "self_attn.k_proj.weight"], out[prefix + "self_attn.v_proj.weight"] = (
                t.split(kv_rows)
            )
        elif rest == "mlp.gate_up.weight":
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = t.chunk(2)
        else:
            raise ValueError(f"parameter {name!r} has no Hugging Face Llama counterpart")
    return {k: v.contiguous().clone() for k, v in out.items()}  # safetensors stores no shared views


def write_hf(
    folder: Path, c: ModelConfig, state: dict[str, torch.Tensor], *, max_positions: int
) -> None:
    """Write ``folder``/config.json and model.safetensors, which ``LlamaForCausalLM.from_pretrained`` reads."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(c, state)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text = json.dumps(hf_config(c, max_positions=max_positions), indent=2)
    (folder / "config.json").write_text(text + "\n", encoding="utf-8")

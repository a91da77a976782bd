"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal attention, named size presets."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from diloco_core.rules import check_field, check_fields, choice, integer, number

__all__ = ["PRESETS", "Llama", "ModelConfig", "count_parameters"]

logger = logging.getLogger(__name__)

# Shapes. "150m" and "1b" count ~150M and ~1.1B parameters in total with a 32000-token vocabulary
# (untied embeddings). "1b" is OpenDiLoCo's / TinyLlama's 1.1B shape; OpenDiLoCo's own "150m" file
# (hidden 1024, intermediate 2688) is 150M *without* its 65M embedding parameters, so ours is narrower.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 128,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 384,
    },
    "150m": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "num_layers": 12,
        "num_heads": 12,
        "num_kv_heads": 12,
        "intermediate_size": 2688,
    },
    "1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "num_layers": 22,
        "num_heads": 32,
        "num_kv_heads": 4,
        "intermediate_size": 5632,
    },
}


_POSITIVE = number(gt=0, noun="a finite number")
_SIZE = integer(low=1, unset=True, valid="an integer >= 1 (or unset for the preset's)")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    preset: str = field(default="tiny", metadata=choice(sorted(PRESETS)))
    """Named shape: tiny (~1M parameters, CPU), 150m or 1b (GPU). The fields below override it."""
    vocab_size: int | None = field(default=None, metadata=_SIZE)
    """Vocabulary size. Unset: the tokenizer's (256 for the byte tokenizer)."""
    hidden_size: int | None = field(default=None, metadata=_SIZE)
    """Width of the residual stream. Unset: the preset's."""
    num_layers: int | None = field(default=None, metadata=_SIZE)
    """Decoder blocks. Unset: the preset's."""
    num_heads: int | None = field(default=None, metadata=_SIZE)
    """Query heads; must divide hidden_size. Unset: the preset's."""
    num_kv_heads: int | None = field(default=None, metadata=_SIZE)
    """Key/value heads (grouped-query attention); must divide num_heads. Unset: the preset's."""
    intermediate_size: int | None = field(default=None, metadata=_SIZE)
    """Width of the SwiGLU feed-forward. Unset: the preset's."""
    rope_theta: float = field(default=10000.0, metadata=_POSITIVE)
    """Base of the rotary embedding frequencies."""
    norm_eps: float = field(default=1e-5, metadata=_POSITIVE)
    """Epsilon of RMSNorm."""
    init_std: float = field(default=0.02, metadata=_POSITIVE)
    """Standard deviation of the normal weight initialisation."""

    def __post_init__(self) -> None:
        check_fields(self)
        r = self._shape(None)
        hidden = r["hidden_size"]
        heads = r["num_heads"]
        kv_heads = r["num_kv_heads"]
        check_field("num_heads", heads, hidden % heads == 0, f"a divisor of hidden_size={hidden}")
        check_field(
            "num_kv_heads", kv_heads, heads % kv_heads == 0, f"a divisor of num_heads={heads}"
        )
        check_field(
            "hidden_size",
            hidden,
            (hidden // heads) % 2 == 0,
            "a multiple of 2 * num_heads (rotary pairs)",
        )

    def _shape(self, vocab_size: int | None) -> dict[str, int]:
        preset = PRESETS[self.preset]
        values = {name: getattr(self, name) for name in preset}
        if values["vocab_size"] is None and vocab_size is not None:
            values["vocab_size"] = vocab_size
        return {k: preset[k] if v is None else v for k, v in values.items()}

    def resolved(self, vocab_size: int | None = None) -> ModelConfig:
        """Every shape field filled in: explicit values, else ``vocab_size`` (vocab only), else the preset's."""
        return replace(self, **self._shape(vocab_size))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: under bf16 autocast the mean of squares loses too many bits.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


def _rotary(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (first half, second half) as Llama does.
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.hidden_size and c.num_heads and c.num_kv_heads
        self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads
        self.head_dim = c.hidden_size // c.num_heads
        self.q = nn.Linear(c.hidden_size, c.num_heads * self.head_dim, bias=False)
        self.kv = nn.Linear(c.hidden_size, 2 * c.num_kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(c.num_heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.num_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            # repeat_interleave rather than SDPA's enable_gqa, which older torch versions lack.
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.hidden_size and c.intermediate_size
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.hidden_size
        self.attn_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = SwiGLU(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only transformer; ``forward(tokens)`` returns next-token logits, shape (batch, seq, vocab)."""

    def __init__(self, config: ModelConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        c = config.resolved()
        assert c.vocab_size and c.hidden_size and c.num_layers
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) weights, output projections scaled by 1/sqrt(2 * layers), unit norms.

        Takes an explicit generator so that worker threads never race on torch's global RNG.
        """
        if self.embed.weight.is_meta:
            return
        std = self.config.init_std
        out_std = std / math.sqrt(2 * len(self.blocks))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(
                    0.0,
                    out_std if name.endswith(("o.weight", "down.weight")) else std,
                    generator=generator,
                )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        head_dim = self.config.hidden_size // self.config.num_heads  # type: ignore[operator]
        cos, sin = _rotary(t, head_dim, self.config.rope_theta, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def count_parameters(config: ModelConfig) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = Llama(config)
    return sum(p.numel() for p in model.parameters())

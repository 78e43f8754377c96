"""GPT-2: learned absolute positions, pre-LayerNorm blocks, a GELU (tanh) MLP, and the
LM head tied to the token embedding. The checkpoint stores every projection in Conv1D
layout ([in, out]) and q/k/v fused in one `c_attn`; the loader reads each rank's part
of them transposed, so the layers are the same tensor-parallel ones as everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cadence.layers.activation import activation
from cadence.layers.attention import Attention
from cadence.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cadence.layers.linear import ColumnParallelLinear, QKVLinear, RowParallelLinear
from cadence.layers.norm import LayerNorm
from cadence.models.loader import Target

# our projections whose checkpoint weights are Conv1D ([in, out])
_CONV1D = (".attn.c_proj.", ".mlp.c_fc.", ".mlp.c_proj.")


@dataclass(slots=True)
class GPT2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float
    activation: str
    scale_attn_weights: bool
    scale_by_inverse_layer_idx: bool

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> GPT2Config:
        hidden = c["n_embd"]
        if c.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention is an encoder-decoder: unsupported")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=hidden,
            intermediate_size=c.get("n_inner") or 4 * hidden,
            num_layers=c["n_layer"],
            num_heads=c["n_head"],
            max_position_embeddings=c.get("n_positions", 1024),
            layer_norm_eps=c.get("layer_norm_epsilon", 1e-5),
            activation=c.get("activation_function", "gelu_new"),
            scale_attn_weights=bool(c.get("scale_attn_weights", True)),
            scale_by_inverse_layer_idx=bool(c.get("scale_attn_by_inverse_layer_idx", False)),
        )

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int) -> None:
        super().__init__()
        head_dim = cfg.head_dim
        self.c_attn = QKVLinear(cfg.hidden_size, head_dim, cfg.num_heads, cfg.num_heads, True)
        self.num_heads = self.c_attn.num_heads  # this rank's heads
        self.head_dim = head_dim
        self.c_proj = RowParallelLinear(
            cfg.hidden_size, cfg.hidden_size, True, self.c_attn.q_features
        )
        scale = head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_by_inverse_layer_idx:
            scale /= layer + 1
        self.attn = Attention(self.num_heads, self.num_heads, head_dim, scale=scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attn = GPT2Attention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # replicated
        self.wpe.weight.requires_grad_(False)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.lm_head.weight = self.transformer.wte.weight  # always tied

    def weight_targets(self, name: str) -> list[Target]:
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return []  # causal-mask buffers of old checkpoints
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # the original checkpoints have no prefix
        if ".attn.c_attn." in name:  # fused [in, 3 * hidden]: q, k, v in that order
            h = self.config.hidden_size
            transposed = name.endswith(".weight")
            return [
                Target(name, part, transposed, rows=(i * h, h))
                for i, part in enumerate(("q", "k", "v"))
            ]
        conv1d = name.endswith(".weight") and any(p in name for p in _CONV1D)
        return [Target(name, transposed=conv1d)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.h]

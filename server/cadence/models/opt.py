"""OPT (facebook/opt-125m … 66b): learned absolute positions (offset by 2), LayerNorm
before each block (or after it, as in opt-350m), biased q/k/v/out projections, a ReLU
MLP, and for opt-350m `project_in`/`project_out` between a narrower embedding and the
hidden size. The LM head is tied to the token embedding.

Written against the tensor-parallel layers and the attention interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cadence.layers.activation import activation
from cadence.layers.attention import Attention
from cadence.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cadence.layers.linear import (
    ColumnParallelLinear,
    QKVLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from cadence.layers.norm import LayerNorm
from cadence.models.loader import Target, packed_targets

POSITION_OFFSET = 2  # OPT's position table starts 2 rows in (a fairseq legacy)


@dataclass(slots=True)
class OPTConfig:
    vocab_size: int
    hidden_size: int
    word_embed_proj_dim: int
    intermediate_size: int  # ffn_dim
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    do_layer_norm_before: bool
    final_layer_norm: bool
    layer_norm_affine: bool
    bias: bool
    activation: str

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> OPTConfig:
        hidden = c["hidden_size"]
        before = bool(c.get("do_layer_norm_before", True))
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=hidden,
            word_embed_proj_dim=c.get("word_embed_proj_dim") or hidden,
            intermediate_size=c["ffn_dim"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            do_layer_norm_before=before,
            final_layer_norm=before and not c.get("_remove_final_layer_norm", False),
            layer_norm_affine=bool(c.get("layer_norm_elementwise_affine", True)),
            bias=bool(c.get("enable_bias", True)),
            activation=c.get("activation_function", "relu"),
        )

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class OPTAttention(nn.Module):
    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        head_dim = cfg.head_dim
        self.qkv_proj = QKVLinear(cfg.hidden_size, head_dim, cfg.num_heads, cfg.num_heads, cfg.bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.head_dim = head_dim
        self.out_proj = RowParallelLinear(
            cfg.hidden_size, cfg.hidden_size, cfg.bias, self.qkv_proj.q_features
        )
        self.attn = Attention(self.num_heads, self.num_heads, head_dim, scale=head_dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, affine=cfg.layer_norm_affine)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.bias)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.bias)
        self.act = activation(cfg.activation)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, affine=cfg.layer_norm_affine)

    def _block(self, x: torch.Tensor, norm: nn.Module, block: Any) -> torch.Tensor:
        """x + block(x), with the norm before the block (pre-norm) or after the sum."""
        if self.pre_norm:
            return x + block(norm(x))
        return norm(x + block(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._block(x, self.self_attn_layer_norm, self.self_attn)
        return self._block(x, self.final_layer_norm, lambda h: self.fc2(self.act(self.fc1(h))))


class OPTDecoder(nn.Module):
    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.word_embed_proj_dim)
        positions = cfg.max_position_embeddings + POSITION_OFFSET
        self.embed_positions = nn.Embedding(positions, cfg.hidden_size)  # small: replicated
        self.embed_positions.weight.requires_grad_(False)
        narrow = cfg.word_embed_proj_dim != cfg.hidden_size
        self.project_in = (
            ReplicatedLinear(cfg.word_embed_proj_dim, cfg.hidden_size, bias=False)
            if narrow
            else None
        )
        self.project_out = (
            ReplicatedLinear(cfg.hidden_size, cfg.word_embed_proj_dim, bias=False)
            if narrow
            else None
        )
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_layer_norm = (
            LayerNorm(cfg.hidden_size, affine=cfg.layer_norm_affine)
            if cfg.final_layer_norm
            else None
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = OPTModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.word_embed_proj_dim)
        self.lm_head.weight = self.model.decoder.embed_tokens.weight  # always tied

    def weight_targets(self, name: str) -> list[Target]:
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name  # the original checkpoints name "decoder.…"
        return packed_targets(name, self.packed_modules)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decoder(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): RMSNorm, rotary
embeddings, grouped-query attention over the paged cache (Mistral's and Qwen2's sliding
window per layer, Qwen3's per-head RMSNorm of q and k), SwiGLU MLP, optionally tied
embeddings.

Written against the tensor-parallel layers and the attention interface, never against
a device. `LlamaForCausalLM.forward` returns hidden states; `compute_logits` projects
only the rows that need logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cadence.layers.activation import SiluAndMul
from cadence.layers.attention import Attention
from cadence.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cadence.layers.linear import MergedColumnParallelLinear, QKVLinear, RowParallelLinear
from cadence.layers.norm import RMSNorm
from cadence.layers.rotary import Rope, RotaryEmbedding, rope_parameters


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before the rotation
    sliding_windows: list[int | None]  # per layer; None: full attention

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> LlamaConfig:
        heads = c["num_attention_heads"]
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        qwen2 = c.get("model_type") == "qwen2"
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope=rope_parameters(c),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,  # Qwen2 always has q/k/v biases
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=c.get("model_type") == "qwen3",
            sliding_windows=sliding_windows(c),
        )


def sliding_windows(c: dict[str, Any]) -> list[int | None]:
    """Each layer's attention window: config.json's `layer_types` when written
    (transformers 5), else Mistral's window on every layer, Qwen2's on the layers from
    `max_window_layers` on when `use_sliding_window`."""
    n, window = c["num_hidden_layers"], c.get("sliding_window")
    if not window:
        return [None] * n
    if c.get("layer_types"):
        return [window if t == "sliding_attention" else None for t in c["layer_types"]]
    if c.get("model_type") == "qwen2":
        if not c.get("use_sliding_window", False):
            return [None] * n
        first = c.get("max_window_layers", n)
        return [window if i >= first else None for i in range(n)]
    return [window] * n


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim,
            cfg.hidden_size,
            bias=cfg.o_bias,
            input_split=self.qkv_proj.q_features,
        )
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            cfg.head_dim,
            scale=cfg.head_dim**-0.5,
            sliding_window=cfg.sliding_windows[layer],
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = rope.apply(q), rope.apply(k)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.angles(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id of the fused layer)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat token ids and positions [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

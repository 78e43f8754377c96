"""Plain torch definitions of the C++ kernels, what their tests compare against (the
norm, SwiGLU and rotary kernels are compared with the torch layers they replace)."""

from __future__ import annotations

import torch

from cadence.kernels.reference import decode_attention_ref

# The definition both kernel families are tested against (float32, sequence by sequence).
paged_decode_attention_ref = decode_attention_ref


def greedy_logprobs_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    ids = logits.argmax(dim=-1)
    return ids, logits.log_softmax(dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)


def rotary_write_kv_ref(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """rotary_write_kv in torch: the rotate-half rotary, then index_copy_ into the caches."""
    head_dim = k_cache.shape[-1]
    q, k, v = qkv[:, : (heads + 2 * kv_heads) * head_dim].split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
    )
    cos = cos.reshape(qkv.shape[0], 1, head_dim)
    sin = sin.reshape(qkv.shape[0], 1, head_dim)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    q = rotate(q.reshape(-1, heads, head_dim))
    k = rotate(k.reshape(-1, kv_heads, head_dim))
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(
        0, slot_mapping, v.reshape(-1, kv_heads, head_dim).to(v_cache.dtype)
    )
    return q

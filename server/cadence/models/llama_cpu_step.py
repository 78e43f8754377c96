"""A Llama forward step on CPU as one flat loop over the layers.

A decode row's work per layer is small (one token), so the generic forward spends as
much time in Python -- eleven module calls, the rotary, cache write and attention as
separate operators, a new tensor for every intermediate -- as in the layer's own
arithmetic. When the `cpu` attention backend runs (the C++ kernels of
`cadence.kernels.cpu`), `LlamaModel` hands every step to `forward_step` instead: per
layer four matrix products and a few C++ calls -- RMSNorm with the residual add; the
rotary, cache write and attention (for a decode-only step all in one call; otherwise
rotary + cache write for every token in one, the decode rows' paged attention, and the
prefill rows through `prefill_attention`); RMSNorm; SwiGLU -- with the norms and the
attention writing into buffers reused by every layer. Every operation rounds as the
generic forward does, so both give the same bits (`server/tests/test_llama_cpu_step.py`);
tensor parallelism all-reduces after the two row-parallel products as the layers do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from cadence.attention_backends.cpu_paged import CpuMetadata
from cadence.attention_backends.torch_sdpa import prefill_attention
from cadence.kernels import cpu as cpu_kernels
from cadence.layers.linear import LinearBase
from cadence.layers.packed import linear

if TYPE_CHECKING:
    from cadence.models.llama import LlamaModel


def _linear(layer: LinearBase, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """The layer's product without its module call (prepacked weight when it has one)."""
    return linear(x, layer.weight, layer.bias if with_bias else None, layer.packed_weight)


def _row_parallel(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """RowParallelLinear.forward without the module call: bias once, then all-reduce."""
    y = _linear(layer, x, with_bias=layer.tp_rank == 0)
    if layer.tp_size > 1:
        dist.all_reduce(y)
    return y


def _check(status: int, kernel: str) -> None:
    if status != 0:
        raise RuntimeError(f"{kernel} failed with status {status}")


def forward_step(
    model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, ctx: CpuMetadata
) -> torch.Tensor:
    """The hidden states after the final norm [T, hidden], as `LlamaModel.forward`
    computes them; rows ordered as the context's (decode rows first)."""
    lib = cpu_kernels._load()
    threads = torch.get_num_threads()
    x = model.embed_tokens(input_ids)
    tokens, hidden = x.shape
    dtype = x.dtype
    dt = cpu_kernels.DTYPES[dtype]
    cos, sin = model.rotary.cos_sin(positions, dtype)  # [T, 1, head_dim], contiguous
    first = model.layers[0].self_attn
    heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
    d = ctx.num_decode
    tables, lens, slots = ctx.decode_tables, ctx.decode_lens, ctx.slot_mapping
    normed = torch.empty_like(x)
    residual = x  # the embedding's own tensor, updated in place from here on
    q_rotated = torch.empty(tokens, heads * head_dim, dtype=dtype)
    attended = torch.empty(tokens, heads * head_dim, dtype=dtype)
    act = None
    eps = model.norm.eps

    def norm(weight: torch.Tensor, src: torch.Tensor, add_residual: bool, out: torch.Tensor):
        r = residual.data_ptr() if add_residual else None
        status = lib.cadence_rms_norm(
            src.data_ptr(), r, weight.data_ptr(), out.data_ptr(), r, tokens, hidden, eps, dt,
            threads,
        )  # fmt: skip
        _check(status, "cadence_rms_norm")

    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        norm(layer.input_layernorm.weight, x, i > 0, normed)
        qkv = _linear(attn.qkv_proj, normed)
        cache = attn.attn
        k_cache, v_cache = cache.k_cache, cache.v_cache
        kv_dt = cpu_kernels.DTYPES[k_cache.dtype]
        block_size, window = k_cache.shape[1], cache.sliding_window
        if d == tokens:  # decode rows only: rotary, cache write and attention in one call
            status = lib.cadence_decode_layer_attention(
                qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                q_rotated.data_ptr(), attended.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
                lens.data_ptr(), d, heads, kv_heads, head_dim, block_size, cache.scale,
                window or 0, dt, kv_dt, threads,
            )  # fmt: skip
            _check(status, "cadence_decode_layer_attention")
        else:
            status = lib.cadence_rotary_write_kv(
                qkv.data_ptr(), tokens, qkv.stride(0), heads, kv_heads, head_dim,
                cos.data_ptr(), sin.data_ptr(), q_rotated.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), slots.data_ptr(), dt, kv_dt, threads,
            )  # fmt: skip
            _check(status, "cadence_rotary_write_kv")
            if d > 0:
                status = lib.cadence_paged_decode_attention(
                    q_rotated.data_ptr(), attended.data_ptr(), k_cache.data_ptr(),
                    v_cache.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                    d, heads, kv_heads, head_dim, block_size, cache.scale, window or 0, dt,
                    kv_dt, threads,
                )  # fmt: skip
                _check(status, "cadence_paged_decode_attention")
            q = q_rotated[d:].view(-1, heads, head_dim)
            assert ctx.prefill is not None
            out = prefill_attention(q, k_cache, v_cache, ctx.prefill, cache.scale, window)
            attended[d:].view(-1, heads, head_dim).copy_(out)
        x = _row_parallel(attn.o_proj, attended)
        norm(layer.post_attention_layernorm.weight, x, True, normed)
        gate_up = _linear(layer.mlp.gate_up_proj, normed)
        if act is None:
            act = torch.empty(tokens, gate_up.shape[1] // 2, dtype=dtype)
        status = lib.cadence_silu_mul(
            gate_up.data_ptr(), act.data_ptr(), tokens, act.shape[1], dt, threads
        )
        _check(status, "cadence_silu_mul")
        x = _row_parallel(layer.mlp.down_proj, act)
    out = torch.empty_like(x)
    norm(model.norm.weight, x, True, out)
    return out

"""The Llama family's step on CPU as one flat loop over the layers: the model runner the
engine picks for a Llama model under the `cpu` attention backend.

A decode row's work per layer is small (one token), so the model's own forward spends as
much time in Python -- eleven module calls, the rotary, cache write and attention as
separate operators, a new tensor for every intermediate -- as in the layer's own
arithmetic. `forward_step` does per layer four matrix products and a few C++ operators
(`torch.ops.cadence`) -- RMSNorm with the residual add; the rotary, cache write and
attention (for a decode-only step all in one call; otherwise rotary + cache write for
every token in one, the decode rows' paged attention, and the prefill rows through the
torch backend's `attend_prefill`); RMSNorm; SwiGLU (in the gate/up product's own call where
that product runs on cadence's AMX-BF16 tiles) -- with the norms and the attention
writing into buffers reused by every layer. Every operation rounds as the model's forward
does, so both give the same bits (`server/tests/test_llama_cpu_flat.py`); tensor
parallelism all-reduces after the two row-parallel products as the layers do.

Where every row of a step attends over the cache (decode rows; with batch invariance, the
prompts' tokens too) and every product is one call of a C++ kernel (cadence's AMX-BF16 or
float32 tiles, the integer product), the whole loop is one C++ call (`decode_layers`,
cpu_ops.cpp): the same operators in the same order, without a Python frame and seven
dispatches per layer (about 2 ms of a 32-row decode step of SmolLM2;
`server/tests/test_decode_layers.py` holds its bits to the loop's).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn

from cadence.attention_backends import StepLayout
from cadence.attention_backends.cpu_paged import CpuAttention, CpuMetadata
from cadence.attention_backends.torch_sdpa import attend_prefill
from cadence.heartbeat import HEARTBEAT
from cadence.layers.linear import LinearBase, lora_delta_due, one_float_call, product
from cadence.layers.packed import (
    HARDWARE_TILES,
    PACKED_VIEWS,
    is_amx_packing,
    is_tile_packing,
)
from cadence.layers.parallel import all_reduce_sum
from cadence.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from cadence.runners.generic import ModelRunner


class LlamaCpuFlatRunner(ModelRunner):
    description = "flat Llama step (C++ kernels)"

    def __init__(self, model: LlamaForCausalLM, attention: CpuAttention) -> None:
        super().__init__(model, attention)
        self.llama = model.model
        self.cpu_attention = attention

    def forward(
        self, layout: StepLayout, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        meta = self.cpu_attention.metadata(layout)
        return forward_step(self.llama, input_ids, positions, meta)


def _amx_weight(layer: LinearBase, rows: int) -> torch.Tensor | None:
    """`layer`'s weight packed for cadence's AMX-BF16 tiles where its product of `rows`
    rows is one call on them (within the layer's row range, no quantized kernel serving
    them, no LoRA delta this step), else None: where the flat step may call the tiles
    itself, or fuse more into that call."""
    packed = layer.packed_weight
    if (
        packed is None
        or not is_amx_packing(packed)
        or not one_float_call(layer, rows)
        or lora_delta_due(layer) is not None
    ):
        return None
    return packed


def _linear(layer: LinearBase, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """The layer's product without its module call (its quantized weight or its
    prepacked one, as the layer's forward would choose). Where that is one AMX-BF16 call,
    the call itself: `product`'s own path to it costs a decode step about a millisecond
    of Python."""
    bias = layer.bias if with_bias else None
    packed = _amx_weight(layer, x.shape[0])
    if packed is None:
        return product(layer, x, bias)
    amx = torch.ops.cadence.bf16_matmul_tiles
    return amx(x, packed, bias, layer.out_features, HARDWARE_TILES)


def _row_parallel(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """RowParallelLinear.forward without the module call: bias once, then all-reduce."""
    y = _linear(layer, x, with_bias=layer.tp_rank == 0)
    if layer.tp_size > 1:
        all_reduce_sum(y)
    return y


def _fused_swiglu(layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU of the gate/up product in one call where its float weight serves these rows
    on cadence's AMX-BF16 tiles (`bf16_matmul_tiles_swiglu`: the bits of the product and
    silu_mul, without writing the product's rows out and reading them back); None where
    another path serves it (a quantized or oneDNN product, a bias, a LoRA delta, a split)."""
    inter = _fusable_inter(layer)
    if inter is None:
        return None
    packed = _amx_weight(layer, x.shape[0])
    if packed is None:
        return None
    return torch.ops.cadence.bf16_matmul_tiles_swiglu(x, packed, inter, HARDWARE_TILES)


def _fusable_inter(gate_up: LinearBase) -> int | None:
    """The SwiGLU width of a fused gate/up layer whose SwiGLU can join its AMX-BF16 call
    (no bias, whole 16-channel blocks of each half), else None."""
    inter = gate_up.out_features // 2
    return inter if gate_up.bias is None and inter % 16 == 0 else None


def _norm_heads(attn: LlamaAttention, qkv: torch.Tensor) -> None:
    """Qwen3's RMSNorm over each head of q and k, written back into the fused QKV rows
    before the kernels rotate them."""
    q_size = attn.num_heads * attn.head_dim
    kv_size = attn.num_kv_heads * attn.head_dim
    assert attn.q_norm is not None and attn.k_norm is not None
    for start, size, norm in ((0, q_size, attn.q_norm), (q_size, kv_size, attn.k_norm)):
        part = qkv[:, start : start + size]
        part.copy_(norm(part.reshape(-1, attn.head_dim)).view_as(part))


class _LayerParts(NamedTuple):
    """A decoder layer's submodules as the flat step reads them, looked up once per model:
    each lookup of a submodule goes through nn.Module.__getattr__, and a decode step made
    about 600 of them."""

    attn: LlamaAttention
    cache: nn.Module  # attn.attn: the layer's KV cache and its attention's settings
    qkv: LinearBase
    o_proj: LinearBase
    gate_up: LinearBase
    down: LinearBase
    input_norm: nn.Module
    post_norm: nn.Module


def _layer_parts(model: LlamaModel) -> list[_LayerParts]:
    """`model`'s layers' parts, kept on the model (its modules never change once built)."""
    parts = model.__dict__.get("_flat_layer_parts")
    if parts is None:
        parts = [
            _LayerParts(
                attn=layer.self_attn,
                cache=layer.self_attn.attn,
                qkv=layer.self_attn.qkv_proj,
                o_proj=layer.self_attn.o_proj,
                gate_up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj,
                input_norm=layer.input_layernorm,
                post_norm=layer.post_attention_layernorm,
            )
            for layer in model.layers
        ]
        model.__dict__["_flat_layer_parts"] = parts
    return parts


# decode_layers' product kinds (cpu_ops.cpp's LayerProduct)
AMX_BF16, INTEGER, FLOAT_TILES = 0, 1, 2


class _LayerStack(NamedTuple):
    """What `decode_layers` reads of a model whose every layer's products are single calls
    of a kernel it knows (no bias, no Qwen3 head norms, one shard): per layer the two norms
    and each product's packed weight and scales (`weights`), each product's (kind,
    out_features, format, tiles) (`specs`) and the sliding window (0: none). Those products
    stay single calls from `rows_from` to `rows_to` rows of `dtype` activations, with the
    integer product's tiles as `integer_tiles` chose them, and with no LoRA delta due in
    `lora_contexts`."""

    weights: list[torch.Tensor]
    specs: list[int]
    windows: list[int]
    scale: float
    rows_from: int
    rows_to: int
    dtype: torch.dtype  # the activations' the kinds were chosen for
    integer_tiles: tuple[tuple[int, int], ...]
    lora_contexts: list[object]


def _product_of(
    layer: LinearBase, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[int], int, int] | None:
    """`layer`'s product as `decode_layers` calls it -- its (packed, scales) tensors, (kind,
    out_features, format, tiles) and the fewest and most rows it serves that way -- or None
    where its Python path is not one call of a kernel `decode_layers` knows."""
    from cadence.quant import cpu_gemm

    packed, quantized = layer.packed_weight, layer.quantized
    if layer.bias is not None or layer.tp_size != 1:
        return None
    n = layer.out_features
    if quantized is not None and not quantized.float_kept:  # the quantized kernel, always
        kernels = quantized.kernels
        if len(kernels) != 1 or not isinstance(kernels[0], cpu_gemm.IntegerCpuKernel):
            return None
        kernel = kernels[0]
        if kernel.perm is not None or dtype not in (torch.float32, torch.bfloat16):
            return None
        w = kernel.weight
        tiles = cpu_gemm.tiles_for_code(w.fmt)
        return [w.packed, w.scales], [INTEGER, n, w.fmt, tiles], layer.min_rows, layer.max_rows
    # the float copy serves the rows the quantized kernel does not (past its crossover)
    fewest = max(layer.min_rows, quantized.crossover + 1 if quantized is not None else 1)
    if packed is not None and is_amx_packing(packed):
        return [packed, packed], [AMX_BF16, n, 0, HARDWARE_TILES], fewest, layer.max_rows
    if packed is not None and is_tile_packing(packed) and dtype is torch.float32:
        most = min(layer.max_rows, layer.packed_max_rows or layer.max_rows)  # then F.linear
        return [packed, packed], [FLOAT_TILES, n, 0, 0], fewest, most
    return None


def _stack_of(
    model: LlamaModel, parts: list[_LayerParts], dtype: torch.dtype
) -> _LayerStack | None:
    """The model's `_LayerStack` for `dtype` activations where it has one, else None."""
    from cadence.quant import cpu_gemm

    weights: list[torch.Tensor] = []
    specs: list[int] = []
    rows_from, rows_to = 1, 1 << 62
    contexts: dict[int, object] = {}
    for part in parts:
        if part.attn.q_norm is not None or part.cache.scale != parts[0].cache.scale:
            return None
        weights += [part.input_norm.weight, part.post_norm.weight]
        for layer in (part.qkv, part.o_proj, part.gate_up, part.down):
            found = _product_of(layer, dtype)
            if found is None:
                return None
            tensors, spec, fewest, most = found
            weights += tensors
            specs += spec
            rows_from, rows_to = max(rows_from, fewest), min(rows_to, most)
            hook = getattr(layer, "lora", None)
            if hook is not None:
                contexts[id(hook.context)] = hook.context
        if specs[-8] == AMX_BF16 and _fusable_inter(part.gate_up) is None:
            return None  # the C++ loop fuses SwiGLU into an AMX-BF16 gate/up product
    windows = [part.cache.sliding_window or 0 for part in parts]
    tiles = cpu_gemm.tiles_chosen()
    scale = parts[0].cache.scale
    return _LayerStack(
        weights, specs, windows, scale, rows_from, rows_to, dtype, tiles, list(contexts.values())
    )


def _layer_stack(model: LlamaModel, rows: int, dtype: torch.dtype) -> _LayerStack | None:
    """The model's `_LayerStack` where a step of `rows` rows of `dtype` activations may run
    its layers in `decode_layers` calls, else None (found once per model and dtype, and
    again if the integer product's tiles were chosen anew, or after the packed weights were
    replaced: `forget_packed_views`)."""
    from cadence.quant import cpu_gemm

    found = model.__dict__.setdefault(PACKED_VIEWS, {})
    stack = found.get(dtype, False)
    if stack is False or (stack and stack.integer_tiles != cpu_gemm.tiles_chosen()):
        stack = found[dtype] = _stack_of(model, _layer_parts(model), dtype)
    if stack is None or not stack.rows_from <= rows <= stack.rows_to:
        return None
    if any(context.step is not None for context in stack.lora_contexts):
        return None
    return stack


# Rows times layers per decode_layers call: a long step's layers go in several calls, the
# heartbeat bumped between them, so the router still sees a long prefill move.
ROW_LAYERS_PER_CALL = 8192
# And about this long a call, at the rate the step's calls so far ran: a prompt's attention
# grows with its length and a larger model's layer takes longer, so a bound in rows alone
# let a call outlast a short --ready-stall-timeout-ms (2-core Zen 3, a 1,000-token prompt
# of the embedded model: 8 layers a call, beats 385-531 ms apart, and /ready read `wedged`
# under a 300 ms timeout; timed, 44-68 ms apart and the step no longer).
BEAT_SECONDS = 0.1


def layers_per_call(budget: int, layers: int, done: int, seconds: float) -> int:
    """Layers for a step's next decode_layers call, of `layers` in all: first, all of them
    where `budget` (its rows' bound) allows, else one, timed; then `budget`, fewer where
    the `done` layers before took `seconds`, so that a call takes about BEAT_SECONDS; at
    least one."""
    if done == 0:
        return budget if budget >= layers else 1
    if seconds <= 0.0:
        return budget
    return max(1, min(budget, int(BEAT_SECONDS * done / seconds)))


def _decode_layers(
    model: LlamaModel, stack: _LayerStack, residual: torch.Tensor, ctx: CpuMetadata,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor | None:  # fmt: skip
    """The layers of a step whose rows all attend over the cache in C++ calls
    (`decode_layers`: all of them in one for a decode step; for more rows, at most
    ROW_LAYERS_PER_CALL rows x layers and about BEAT_SECONDS a call): the per-layer loop
    of `forward_step` without its Python, the same bits. None where the caches' scales
    are not all there or all absent."""
    caches: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    for part in _layer_parts(model):
        cache = part.cache
        caches += [cache.k_cache, cache.v_cache]
        if cache.k_scale is not None:
            scales += [cache.k_scale, cache.v_scale]
    if scales and len(scales) != len(caches):
        return None
    first = model.layers[0].self_attn
    layers = len(stack.windows)
    budget = max(1, ROW_LAYERS_PER_CALL // residual.shape[0])
    per_call = layers_per_call(budget, layers, 0, 0.0)
    x = None
    a, spent = 0, 0.0
    while a < layers:
        b = min(layers, a + per_call)
        HEARTBEAT.beat()
        started = time.perf_counter()
        x = torch.ops.cadence.decode_layers(
            residual, x, stack.weights[10 * a : 10 * b], stack.specs[16 * a : 16 * b],
            caches[2 * a : 2 * b], scales[2 * a : 2 * b], stack.windows[a:b], cos, sin,
            ctx.slot_mapping, ctx.decode_tables, ctx.decode_lens, first.num_heads,
            first.num_kv_heads, stack.scale, model.norm.eps,
        )  # fmt: skip
        spent += time.perf_counter() - started
        a = b
        per_call = layers_per_call(budget, layers, a, spent)
    HEARTBEAT.beat()
    return x


def forward_step(
    model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, ctx: CpuMetadata
) -> torch.Tensor:
    """The hidden states after the final norm [T, hidden], as `LlamaModel.forward`
    computes them; rows ordered as the context's (decode rows first)."""
    residual = model.embed_tokens(input_ids)  # its own tensor, updated in place from here on
    tokens, dtype = residual.shape[0], residual.dtype
    cos, sin = model.rotary.cos_sin(positions, dtype)  # [T, 1, head_dim], contiguous
    stack = _layer_stack(model, tokens, dtype) if ctx.num_decode == tokens else None
    last = _decode_layers(model, stack, residual, ctx, cos, sin) if stack else None
    if last is None:
        last = _python_layers(model, residual, ctx, cos, sin)
    out = torch.empty_like(last)
    torch.ops.cadence.add_rms_norm_(residual, last, model.norm.weight, model.norm.eps, out)
    return out


def _python_layers(
    model: LlamaModel, residual: torch.Tensor, ctx: CpuMetadata, cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The layers one by one from the embedding `residual` (updated in place): the last
    layer's output, the final norm's input."""
    ops = torch.ops.cadence  # the C++ kernels (loaded when the engine selected them)
    x = residual
    tokens, dtype = x.shape[0], x.dtype
    first = model.layers[0].self_attn
    heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
    d = ctx.num_decode
    tables, lens, slots = ctx.decode_tables, ctx.decode_lens, ctx.slot_mapping
    normed = torch.empty_like(x)
    q_rotated = torch.empty(tokens, heads * head_dim, dtype=dtype)
    attended = torch.empty(tokens, heads * head_dim, dtype=dtype)
    q_heads = q_rotated.view(tokens, heads, head_dim)  # both as the kernels write them
    attended_heads = attended.view(tokens, heads, head_dim)
    act = None
    eps = model.norm.eps

    def norm(weight: torch.Tensor, src: torch.Tensor, add_residual: bool, out: torch.Tensor):
        if add_residual:  # residual += src in place, out = its norm
            ops.add_rms_norm_(residual, src, weight, eps, out)
        else:
            ops.rms_norm.out(src, weight, eps, out)

    for i, layer in enumerate(_layer_parts(model)):
        HEARTBEAT.beat()  # a layer's worth of progress, seen by Health
        attn = layer.attn
        norm(layer.input_norm.weight, x, i > 0, normed)
        qkv = _linear(layer.qkv, normed)
        if attn.q_norm is not None:
            _norm_heads(attn, qkv)
        cache = layer.cache
        k_cache, v_cache = cache.k_cache, cache.v_cache
        k_scale, v_scale = cache.k_scale, cache.v_scale  # a quantized cache's, else None
        window = cache.sliding_window
        if d == tokens:  # decode rows only: rotary, cache write and attention in one call
            ops.decode_layer_attention.out(
                qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, tables, lens,
                cache.scale, window, q_heads, attended_heads, k_scale, v_scale,
            )  # fmt: skip
        else:
            ops.rotary_write_kv.out(
                qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, q_heads, k_scale,
                v_scale,
            )  # fmt: skip
            if d > 0:
                ops.paged_decode_attention.out(
                    q_heads[:d], k_cache, v_cache, tables, lens, cache.scale, window,
                    attended_heads[:d], k_scale, v_scale,
                )  # fmt: skip
            attend_prefill(cache, q_heads[d:], ctx.prefill, attended_heads[d:])
        x = _row_parallel(layer.o_proj, attended)
        norm(layer.post_norm.weight, x, True, normed)
        fused = _fused_swiglu(layer.gate_up, normed)
        if fused is None:
            gate_up = _linear(layer.gate_up, normed)
            if act is None:
                act = torch.empty(tokens, gate_up.shape[1] // 2, dtype=dtype)
            ops.silu_mul.out(gate_up, act)
        x = _row_parallel(layer.down, act if fused is None else fused)
    return x

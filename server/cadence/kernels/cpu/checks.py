"""What each operator of `ops.py` requires of its arguments, checked in one place: the
operator's CPU implementation and its fake (the one torch.compile and `opcheck` trace
with) both call these, which return the sizes the kernel call needs. The device is the
dispatcher's to check for the CPU implementation (only CPU tensors reach it) and
`on_cpu`'s for the fake.

The C++ kernels read and write through raw pointers, so these checks are what keeps a
wrong shape, dtype, device or layout from becoming an out-of-bounds access. Tensors the
kernel only reads may have any strides (the operator packs them when they are not);
tensors it writes must already have the layout it writes, since a packed copy would lose
the write. The values inside the index tensors (block ids, slots, context lengths) are
the scheduler's and are not scanned: that would be a pass over them on every call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The dtypes the kernels are compiled for, by the code their C entry points take
# (`DType` in cpu_kernels.cpp).
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
GREEDY_DTYPES = (torch.float32, torch.bfloat16)


def _describe(t: torch.Tensor) -> str:
    layout = "" if t.is_contiguous() else f", strides {t.stride()}"
    return f"{t.dtype} {list(t.shape)} on {t.device}{layout}"


def _bad(op: str, arg: str, want: str, t: torch.Tensor | None = None) -> ValueError:
    got = "" if t is None else f", got {_describe(t)}"
    return ValueError(f"cadence::{op}: {arg} must be {want}{got}")


def on_cpu(op: str, names: Sequence[str], args: Sequence[object]) -> None:
    """Every tensor among `args` (named by `names`, the schema's) is a CPU tensor. Only the
    fake implementations ask: the dispatcher gives the CPU one CPU tensors alone (a call
    with a tensor elsewhere goes to that device's kernel, or to the fake for meta)."""
    for name, arg in zip(names, args, strict=False):  # trailing defaults may be left out
        if isinstance(arg, torch.Tensor) and not arg.is_cpu:
            raise _bad(op, name, "a CPU tensor", arg)


# Every call of the flat decode step passes through here (four per layer), so each check
# reads a tensor's metadata once into locals and compares those.


def _written(op: str, arg: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype):
    """t is where the kernel writes `shape` elements of `dtype`: contiguous, nothing else."""
    if t.shape != shape or t.dtype != dtype or not t.is_contiguous():
        raise _bad(op, arg, f"a contiguous {dtype} {list(shape)}", t)


def _cache(
    op: str, dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int, int]:
    """The paged caches [blocks, block_size, kv_heads, head_dim], contiguous (the kernels
    index them in place), of one dtype the kernels pair with `dtype` activations: the
    same, or one of the two float32. -> (block_size, kv_heads, head_dim)."""
    shape, kv_dtype = k_cache.shape, k_cache.dtype
    if len(shape) != 4 or not k_cache.is_contiguous() or not shape[2] or not shape[3]:
        want = "a contiguous [blocks, block_size, kv_heads, head_dim] tensor"
        raise _bad(op, "k_cache", want, k_cache)
    if v_cache.shape != shape or v_cache.dtype != kv_dtype or not v_cache.is_contiguous():
        raise _bad(
            op,
            "v_cache",
            f"contiguous, shaped and typed as k_cache ({_describe(k_cache)})",
            v_cache,
        )
    if kv_dtype not in DTYPES:
        raise _bad(op, "k_cache", "float32, bfloat16 or float16", k_cache)
    if kv_dtype != dtype and dtype != torch.float32 and kv_dtype != torch.float32:
        raise ValueError(
            f"cadence::{op}: no kernel for {dtype} activations over a {kv_dtype} cache "
            "(k_cache, v_cache): the cache is in their dtype, or one of the two is float32"
        )
    return shape[1], shape[2], shape[3]


def _cos_sin(
    op: str, cos: torch.Tensor, sin: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype
) -> None:
    """cos and sin [tokens, (1,) head_dim] in the activations' dtype."""
    shape = cos.shape
    if (
        cos.dtype != dtype
        or len(shape) < 2
        or shape[0] != tokens
        or shape[-1] != head_dim
        or cos.numel() != tokens * head_dim
    ):
        raise _bad(op, "cos", f"{dtype} [{tokens}, (1,) {head_dim}]", cos)
    if sin.shape != shape or sin.dtype != dtype:
        raise _bad(op, "sin", f"shaped and typed as cos ({_describe(cos)})", sin)


def _decode_rows(
    op: str, seqs: int, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> None:
    """A block table row and a context length per sequence."""
    shape = block_tables.shape
    if block_tables.dtype != torch.int64 or len(shape) != 2 or shape[0] != seqs:
        raise _bad(op, "block_tables", f"int64 [{seqs}, blocks]", block_tables)
    if context_lens.dtype != torch.int64 or context_lens.shape != (seqs,):
        raise _bad(op, "context_lens", f"int64 [{seqs}]", context_lens)


def paged_decode_attention(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    """-> (seqs, heads, kv_heads, head_dim, block_size)."""
    shape, dtype = q.shape, q.dtype
    if len(shape) != 3 or dtype not in DTYPES:
        raise _bad(op, "q", "float32, bfloat16 or float16 [seqs, heads, head_dim]", q)
    block_size, kv_heads, head_dim = _cache(op, dtype, k_cache, v_cache)
    seqs, heads, q_dim = shape
    if q_dim != head_dim or heads % kv_heads:
        raise _bad(op, "q", f"[seqs, a multiple of {kv_heads} heads, {head_dim}]", q)
    _decode_rows(op, seqs, block_tables, context_lens)
    if out is not None:
        _written(op, "out", out, shape, dtype)
    return seqs, heads, kv_heads, head_dim, block_size


def greedy_logprobs(op: str, logits: torch.Tensor) -> tuple[int, int]:
    """-> (rows, vocab)."""
    shape = logits.shape
    if len(shape) != 2 or logits.dtype not in GREEDY_DTYPES or not shape[1]:
        raise _bad(op, "logits", "float32 or bfloat16 [rows, vocab > 0]", logits)
    return shape[0], shape[1]


def rms_norm(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    residual_written: bool = False,
) -> tuple[int, int]:
    """-> (rows, hidden)."""
    shape, dtype = x.shape, x.dtype
    if len(shape) != 2 or dtype not in DTYPES:
        raise _bad(op, "x", "float32, bfloat16 or float16 [rows, hidden]", x)
    if weight.shape != shape[1:] or weight.dtype != dtype:
        raise _bad(op, "weight", f"{dtype} [{shape[1]}]", weight)
    if residual is not None:
        if residual_written:
            _written(op, "residual", residual, shape, dtype)
        elif residual.shape != shape or residual.dtype != dtype:
            raise _bad(op, "residual", f"{dtype} {list(shape)}", residual)
    if out is not None:
        _written(op, "out", out, shape, dtype)
    return shape[0], shape[1]


def silu_mul(op: str, x: torch.Tensor, out: torch.Tensor | None) -> tuple[int, int]:
    """-> (rows, inter)."""
    shape, dtype = x.shape, x.dtype
    if len(shape) != 2 or shape[1] % 2 or dtype not in DTYPES:
        raise _bad(op, "x", "float32, bfloat16 or float16 [rows, 2 * inter] (gate | up)", x)
    rows, inter = shape[0], shape[1] // 2
    if out is not None:
        _written(op, "out", out, (rows, inter), dtype)
    return rows, inter


def rotary_(op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int, int]:
    """-> (tokens, heads, head_dim)."""
    shape, dtype = x.shape, x.dtype
    if len(shape) != 3 or shape[2] % 2 or x.stride()[1:] != (shape[2], 1) or dtype not in DTYPES:
        want = "float32, bfloat16 or float16 [tokens, heads, even head_dim], each token's "
        raise _bad(op, "x", want + "heads packed (strides *, head_dim, 1)", x)
    tokens, heads, head_dim = shape
    _cos_sin(op, cos, sin, tokens, head_dim, dtype)
    return tokens, heads, head_dim


def rotary_write_kv(
    op: str,
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor | None,
) -> tuple[int, int, int]:
    """-> (tokens, head_dim, block_size)."""
    shape, dtype = qkv.shape, qkv.dtype
    if len(shape) != 2 or qkv.stride()[1] != 1 or dtype not in DTYPES:
        want = "float32, bfloat16 or float16 [tokens, (heads | kv_heads | kv_heads) * head_dim]"
        raise _bad(op, "qkv", want + ", each row packed", qkv)
    block_size, cache_kv_heads, head_dim = _cache(op, dtype, k_cache, v_cache)
    if heads <= 0:
        raise ValueError(f"cadence::{op}: heads must be positive, got {heads}")
    if kv_heads != cache_kv_heads:
        raise ValueError(
            f"cadence::{op}: kv_heads must be the cache's {cache_kv_heads}, got {kv_heads}"
        )
    if head_dim % 2:
        raise _bad(op, "k_cache", "of an even head_dim (the rotary pairs its halves)", k_cache)
    tokens = shape[0]
    if shape[1] < (heads + 2 * kv_heads) * head_dim:
        need = f"(heads {heads} + 2 x kv_heads {kv_heads}) x head_dim {head_dim}"
        raise _bad(op, "qkv", f"[tokens, at least {need} columns]", qkv)
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (tokens,):
        raise _bad(op, "slot_mapping", f"int64 [{tokens}]", slot_mapping)
    _cos_sin(op, cos, sin, tokens, head_dim, dtype)
    if q_out is not None:
        _written(op, "q_out", q_out, (tokens, heads, head_dim), dtype)
    return tokens, head_dim, block_size


def decode_layer_attention(
    op: str,
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    q_out: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, int, int]:
    """rotary_write_kv's arguments, then the decode attention's over q_out, one token per
    sequence. -> (seqs, head_dim, block_size)."""
    seqs, head_dim, block_size = rotary_write_kv(
        op, qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, q_out
    )
    if heads % kv_heads:
        raise ValueError(
            f"cadence::{op}: heads ({heads}) must be a multiple of kv_heads ({kv_heads})"
        )
    _decode_rows(op, seqs, block_tables, context_lens)
    _written(op, "out", out, (seqs, heads, head_dim), qkv.dtype)
    return seqs, head_dim, block_size

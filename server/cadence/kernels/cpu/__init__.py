"""C++ kernels for the shard's CPU path (the `*_kernels.cpp` beside this file, one per op
family; `cpu_kernels.h` declares their entry points), registered as torch operators in the
`cadence` namespace (`torch.ops.cadence.*`) by a C++ shim (`cpu_ops.cpp`), with a plain
torch reference beside each (`reference.py`), which is what the tests compare against.

The kernels are compiled once per instruction set (`isa.ISAS`: AVX-512 with BF16,
AVX-512, AVX2 + FMA + F16C, portable scalar), each with its own explicit `-march`, by the
machine's C++ compiler (`cadence/kernels/cpu_builds.py`), into plain-C libraries that
know nothing of torch.
One library per instruction set rather than one binary holding all of them: the inline
and template functions that each copy instantiates (the standard library's among them)
would otherwise be merged across copies by the linker, and an AVX-512 instance could end
up called on an AVX2 CPU. The shim, which has no vector code, is compiled once against
torch's headers. `make install` builds all of them ahead of time (`python -m
cadence.kernels.cpu`); a missing one is built on first use. Which library the operators
call is decided once, at start, from what the CPU reports (`selection.py`: `select`,
`--cpu-isa`, `$CADENCE_CPU_ISA`), so a build made on one machine runs on another. The
first selection loads the shim, which registers the operators (`torch.ops.cadence` has
none before it), and each selection hands it the library's path (`ops.py`): it `dlopen`s
the library and calls its entry points through function pointers.

Every call goes through an operator, and from the dispatcher on stays in C++: its
arguments' shapes, dtypes, device and layout are checked in one place
(`cpu_ops_checks.h`, shared with the Meta implementation that FakeTensor tracing,
torch.compile and `torch.library.opcheck` run); a failed check is a ValueError naming the
argument, and a kernel's non-zero status a RuntimeError naming it. OpenMP is torch's own
runtime (its libgomp is loaded before the libraries).

The functions below keep the callers' signatures (optional residual, optional out) over
the operators. Without a compiler, or without torch's C++ headers, `available()` is False
and the shard keeps the torch backend.
"""

from __future__ import annotations

import torch

from cadence import cpu_isa as isa
from cadence.kernels.cpu import ops
from cadence.kernels.cpu.reference import (
    greedy_logprobs_ref,
    paged_decode_attention_ref,
    rotary_write_kv_ref,
)
from cadence.kernels.cpu.selection import (
    available,
    library,
    not_selectable,
    select,
    selected,
    selected_isa,
    unavailable_reason,
)
from cadence.kernels.cpu_builds import KernelBuildError, build

__all__ = [
    "DTYPES",
    "KernelBuildError",
    "available",
    "build",
    "greedy_logprobs",
    "greedy_logprobs_ref",
    "isa",
    "library",
    "not_selectable",
    "ops",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "rms_norm",
    "rotary_",
    "rotary_write_kv",
    "rotary_write_kv_ref",
    "select",
    "selected",
    "selected_isa",
    "silu_mul",
    "unavailable_reason",
]

# The dtypes the kernels are compiled for.
DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

_cadence = torch.ops.cadence  # its operators exist once the kernels are selected


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, heads, head_dim], one query per sequence at position context_lens - 1;
    caches [num_blocks, block_size, kv_heads, head_dim] (q's dtype, or either one
    float32, or int8 / fp8 with their scales k_scale, v_scale: `cadence.kv_format`);
    block_tables [B, >= blocks needed] int64 -> [B, heads, head_dim] in q's dtype (into
    `out` when given). Keys and values are read through the block table in place; the
    query heads sharing a KV head are computed together."""
    if out is None:
        return _cadence.paged_decode_attention.default(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
            k_scale, v_scale,
        )  # fmt: skip
    _cadence.paged_decode_attention.out(
        q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, out,
        k_scale, v_scale,
    )  # fmt: skip
    return out


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, vocab] float32 or bfloat16 -> (argmax ids [R] int64, their float32
    log-probabilities [R])."""
    return _cadence.greedy_logprobs.default(logits)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Llama's RMSNorm of x [T, hidden] (of x + residual when given, which is returned as
    the new residual) in one pass: (normed, new residual or None)."""
    if residual is None:
        return _cadence.rms_norm.default(x, weight, eps), None
    return _cadence.add_rms_norm.default(residual, x, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU over a fused [T, 2 * inter] gate/up projection -> [T, inter]."""
    return _cadence.silu_mul.default(x)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies the rotary embedding in place to x [T, heads, head_dim] (rows may be a
    strided view into a fused QKV output); cos/sin [T, 1 or absent, head_dim] in x's dtype."""
    _cadence.rotary_.default(x, cos, sin)
    return x


def rotary_write_kv(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first half of a Llama attention layer for T new tokens, in one pass over a
    fused QKV output qkv [T, (heads + 2 kv_heads) * head_dim]: the queries rotated into
    q_out [T, heads, head_dim] (returned), the keys rotated and the values copied into
    their slots of the paged caches [blocks, block_size, kv_heads, head_dim] (the cache
    may be another dtype; an int8 cache's per-token scales are written into k_scale and
    v_scale, an fp8 cache's layer scales read from them). cos/sin: [T, (1,) head_dim] in
    qkv's dtype."""
    if q_out is None:
        return _cadence.rotary_write_kv.default(
            qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale
        )
    _cadence.rotary_write_kv.out(
        qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, q_out, k_scale, v_scale
    )
    return q_out

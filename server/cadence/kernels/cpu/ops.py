"""The C++ kernels as torch operators, `torch.ops.cadence.*`: the one module that calls
their entry points.

Each operator has a schema (what it writes is marked `(a!)`); a CPU implementation that
checks its arguments (`checks.py`), calls the entry point of the selected instruction
set's library (`selection.current()`) through ctypes, which releases the GIL, and turns a
non-zero status into a KernelError naming the entry point; and a fake implementation (the
same checks, then empty outputs) for FakeTensor tracing: torch.compile, export and
`torch.library.opcheck`. A call with a tensor on another device never reaches the CPU
implementation: the dispatcher sends it to that device's kernel (there is none: an error
naming the operator) or, for meta tensors, to the fake one.

    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           sliding_window=None) -> out
    paged_decode_attention.out(..., sliding_window, out!)
    greedy_logprobs(logits) -> (ids, logprobs)
    rms_norm(x, weight, eps) -> out
    rms_norm.out(x, weight, eps, out!)
    add_rms_norm(residual, x, weight, eps) -> (out, residual + x)
    add_rms_norm_(residual!, x, weight, eps, out!)     residual += x, then out = its norm
    silu_mul(x) -> out
    silu_mul.out(x, out!)
    rotary_(x!, cos, sin)
    rotary_write_kv(qkv, heads, kv_heads, cos, sin, k_cache!, v_cache!, slot_mapping) -> q
    rotary_write_kv.out(..., slot_mapping, q_out!)
    decode_layer_attention.out(qkv, heads, kv_heads, cos, sin, k_cache!, v_cache!,
                               slot_mapping, block_tables, context_lens, scale,
                               sliding_window, q_out!, out!)

The out= and in-place variants return nothing (the flat decode step writes its reused
buffers with them); the functional ones return new tensors.

Per-call cost, which the flat decode step pays four times a layer: registered with
`Library.define` / `Library.impl` rather than `@torch.library.custom_op`, whose Python
wrapper costs ~2.6 µs more a call; the outputs are positional arguments, not keyword-only
as in ATen's out= overloads (a keyword costs the dispatcher ~0.6 µs a call, though callers
may still name them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from cadence.kernels.cpu import checks, selection
from cadence.kernels.cpu.checks import DTYPES

Tensor = torch.Tensor

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
# The entry points of cpu_kernels.cpp (each returns a status, 0 for success).
_SIGNATURES = {
    "cadence_paged_decode_attention": [
        _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _f32, _i64, _i32,
        _i32, _i32,
    ],
    "cadence_greedy_logprobs": [_ptr, _i64, _i64, _ptr, _ptr, _i32, _i32],
    "cadence_rms_norm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _i32, _i32],
    "cadence_silu_mul": [_ptr, _ptr, _i64, _i64, _i32, _i32],
    "cadence_rotary": [_ptr, _i64, _i32, _i32, _i64, _ptr, _ptr, _i32, _i32],
    "cadence_rotary_write_kv": [
        _ptr, _i64, _i64, _i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _i32,
    ],
    "cadence_decode_layer_attention": [
        _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i32, _i32,
        _i32, _i32, _f32, _i64, _i32, _i32, _i32,
    ],
}  # fmt: skip
# The statuses of cpu_kernels.cpp's `Status`.
_STATUSES = {1: "the query heads are not a multiple of the KV heads", 2: "no kernel for the dtypes"}


class KernelError(RuntimeError):
    """An entry point of the C++ kernels returned a non-zero status."""


def _failed(entry_point: str, status: int) -> KernelError:
    why = _STATUSES.get(status, "an unknown status")
    isa = selection.selected_isa()
    return KernelError(f"{entry_point} ({isa} kernels) failed with status {status}: {why}")


_declared: ctypes.CDLL | None = None


def _kernels() -> ctypes.CDLL:
    """The selected instruction set's library, its entry points typed (once per library:
    declaring is idempotent, so two threads racing here both leave it declared)."""
    global _declared
    lib = selection.current()
    if lib is not _declared:
        for name, argtypes in _SIGNATURES.items():
            entry = getattr(lib, name)
            entry.argtypes = argtypes
            entry.restype = _i32
        _declared = lib
    return lib


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 2-D index tensor with each row packed (a block table may be a view of a wider
    one), and its row stride."""
    stride = t.stride()
    if stride[1] != 1:
        t = t.contiguous()
        stride = t.stride()
    return t, stride[0]


# ---- paged decode attention --------------------------------------------------------------


def _attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    window: int | None,
    out: Tensor,
    sizes: tuple[int, ...],
) -> None:
    seqs, heads, kv_heads, head_dim, block_size = sizes
    if seqs == 0:
        return
    q, lens = q.contiguous(), context_lens.contiguous()
    tables, table_stride = _rows(block_tables)
    status = _kernels().cadence_paged_decode_attention(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        table_stride, lens.data_ptr(), seqs, heads, kv_heads, head_dim, block_size, scale,
        window or 0, DTYPES[q.dtype], DTYPES[k_cache.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise _failed("cadence_paged_decode_attention", status)


def _paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    sizes = checks.paged_decode_attention(
        "paged_decode_attention", q, k_cache, v_cache, block_tables, context_lens, None
    )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _attend(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, out, sizes)
    return out


def _paged_decode_attention_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    checks.paged_decode_attention(
        "paged_decode_attention", q, k_cache, v_cache, block_tables, context_lens, None
    )
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _paged_decode_attention_out(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    out: Tensor,
) -> None:
    sizes = checks.paged_decode_attention(
        "paged_decode_attention.out", q, k_cache, v_cache, block_tables, context_lens, out
    )
    _attend(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, out, sizes)


def _paged_decode_attention_out_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    out: Tensor,
) -> None:
    checks.paged_decode_attention(
        "paged_decode_attention.out", q, k_cache, v_cache, block_tables, context_lens, out
    )


# ---- greedy sampling ---------------------------------------------------------------------


def _greedy_logprobs(logits: Tensor) -> tuple[Tensor, Tensor]:
    rows, vocab = checks.greedy_logprobs("greedy_logprobs", logits)
    logits = logits.contiguous()
    ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    if rows:
        status = _kernels().cadence_greedy_logprobs(
            logits.data_ptr(), rows, vocab, ids.data_ptr(), logprobs.data_ptr(),
            DTYPES[logits.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise _failed("cadence_greedy_logprobs", status)
    return ids, logprobs


def _greedy_logprobs_fake(logits: Tensor) -> tuple[Tensor, Tensor]:
    rows, _ = checks.greedy_logprobs("greedy_logprobs", logits)
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32)


# ---- RMSNorm, with or without the residual add --------------------------------------------


def _normalize(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    out: Tensor,
    residual_out: Tensor | None,
    rows: int,
    hidden: int,
    eps: float,
) -> None:
    status = _kernels().cadence_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), None if residual_out is None else residual_out.data_ptr(), rows, hidden,
        eps, DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise _failed("cadence_rms_norm", status)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    rows, hidden = checks.rms_norm("rms_norm", x, weight, None, None)
    x = x.contiguous()
    out = torch.empty_like(x)
    _normalize(x, None, weight.contiguous(), out, None, rows, hidden, eps)
    return out


def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    checks.rms_norm("rms_norm", x, weight, None, None)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rms_norm_out(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    rows, hidden = checks.rms_norm("rms_norm.out", x, weight, None, out)
    _normalize(x.contiguous(), None, weight.contiguous(), out, None, rows, hidden, eps)


def _rms_norm_out_fake(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    checks.rms_norm("rms_norm.out", x, weight, None, out)


def _add_rms_norm(residual: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rows, hidden = checks.rms_norm("add_rms_norm", x, weight, residual, None)
    x = x.contiguous()
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    _normalize(x, residual.contiguous(), weight.contiguous(), out, residual_out, rows, hidden, eps)
    return out, residual_out


def _add_rms_norm_fake(
    residual: Tensor, x: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    checks.rms_norm("add_rms_norm", x, weight, residual, None)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


def _add_rms_norm_(residual: Tensor, x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    rows, hidden = checks.rms_norm("add_rms_norm_", x, weight, residual, out, True)
    _normalize(x.contiguous(), residual, weight.contiguous(), out, residual, rows, hidden, eps)


def _add_rms_norm_fake_(
    residual: Tensor, x: Tensor, weight: Tensor, eps: float, out: Tensor
) -> None:
    checks.rms_norm("add_rms_norm_", x, weight, residual, out, True)


# ---- SwiGLU ------------------------------------------------------------------------------


def _swiglu(x: Tensor, out: Tensor, rows: int, inter: int) -> None:
    status = _kernels().cadence_silu_mul(
        x.data_ptr(), out.data_ptr(), rows, inter, DTYPES[x.dtype], torch.get_num_threads()
    )
    if status:
        raise _failed("cadence_silu_mul", status)


def _silu_mul(x: Tensor) -> Tensor:
    rows, inter = checks.silu_mul("silu_mul", x, None)
    out = torch.empty(rows, inter, dtype=x.dtype)
    _swiglu(x.contiguous(), out, rows, inter)
    return out


def _silu_mul_fake(x: Tensor) -> Tensor:
    rows, inter = checks.silu_mul("silu_mul", x, None)
    return x.new_empty(rows, inter)


def _silu_mul_out(x: Tensor, out: Tensor) -> None:
    rows, inter = checks.silu_mul("silu_mul.out", x, out)
    _swiglu(x.contiguous(), out, rows, inter)


def _silu_mul_out_fake(x: Tensor, out: Tensor) -> None:
    checks.silu_mul("silu_mul.out", x, out)


# ---- rotary embedding, alone or with the KV-cache write (and the decode attention) --------


def _rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    tokens, heads, head_dim = checks.rotary_("rotary_", x, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    status = _kernels().cadence_rotary(
        x.data_ptr(), tokens, heads, head_dim, x.stride()[0], cos.data_ptr(), sin.data_ptr(),
        DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise _failed("cadence_rotary", status)


def _rotary_fake_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    checks.rotary_("rotary_", x, cos, sin)


def _write_kv(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    q_out: Tensor,
    sizes: tuple[int, ...],
) -> None:
    tokens, head_dim, _ = sizes
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    status = _kernels().cadence_rotary_write_kv(
        qkv.data_ptr(), tokens, qkv.stride()[0], heads, kv_heads, head_dim, cos.data_ptr(),
        sin.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), DTYPES[qkv.dtype], DTYPES[k_cache.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise _failed("cadence_rotary_write_kv", status)


def _rotary_write_kv(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    tokens, head_dim, _ = sizes = checks.rotary_write_kv(
        "rotary_write_kv", qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, None
    )
    q_out = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
    _write_kv(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, q_out, sizes)
    return q_out


def _rotary_write_kv_fake(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    tokens, head_dim, _ = checks.rotary_write_kv(
        "rotary_write_kv", qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, None
    )
    return qkv.new_empty(tokens, heads, head_dim)


def _rotary_write_kv_out(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    q_out: Tensor,
) -> None:
    sizes = checks.rotary_write_kv(
        "rotary_write_kv.out", qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping,
        q_out,
    )  # fmt: skip
    _write_kv(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, q_out, sizes)


def _rotary_write_kv_out_fake(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    q_out: Tensor,
) -> None:
    checks.rotary_write_kv(
        "rotary_write_kv.out", qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping,
        q_out,
    )  # fmt: skip


def _decode_layer_attention_out(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    q_out: Tensor,
    out: Tensor,
) -> None:
    seqs, head_dim, block_size = checks.decode_layer_attention(
        "decode_layer_attention.out", qkv, heads, kv_heads, cos, sin, k_cache, v_cache,
        slot_mapping, block_tables, context_lens, q_out, out,
    )  # fmt: skip
    if seqs == 0:
        return
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    lens = context_lens.contiguous()
    tables, table_stride = _rows(block_tables)
    status = _kernels().cadence_decode_layer_attention(
        qkv.data_ptr(), qkv.stride()[0], cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
        out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        tables.data_ptr(), table_stride, lens.data_ptr(), seqs, heads, kv_heads, head_dim,
        block_size, scale, sliding_window or 0, DTYPES[qkv.dtype], DTYPES[k_cache.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise _failed("cadence_decode_layer_attention", status)


def _decode_layer_attention_out_fake(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    q_out: Tensor,
    out: Tensor,
) -> None:
    checks.decode_layer_attention(
        "decode_layer_attention.out", qkv, heads, kv_heads, cos, sin, k_cache, v_cache,
        slot_mapping, block_tables, context_lens, q_out, out,
    )  # fmt: skip


# ---- registration ------------------------------------------------------------------------

# A fragment: other modules may add operators to the `cadence` namespace too.
LIBRARY = torch.library.Library("cadence", "FRAGMENT")

_ATTENTION_OUT = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
    "float scale, int? sliding_window"
)
_ATTENTION = f"{_ATTENTION_OUT}=None"
_WRITE_KV = (
    "Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slot_mapping"
)
_OPERATORS: list[tuple[str, Callable, Callable]] = [
    (
        f"paged_decode_attention({_ATTENTION}) -> Tensor",
        _paged_decode_attention,
        _paged_decode_attention_fake,
    ),
    (
        f"paged_decode_attention.out({_ATTENTION_OUT}, Tensor(a!) out) -> ()",
        _paged_decode_attention_out,
        _paged_decode_attention_out_fake,
    ),
    ("greedy_logprobs(Tensor logits) -> (Tensor, Tensor)", _greedy_logprobs, _greedy_logprobs_fake),
    ("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", _rms_norm, _rms_norm_fake),
    (
        "rms_norm.out(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()",
        _rms_norm_out,
        _rms_norm_out_fake,
    ),
    (
        "add_rms_norm(Tensor residual, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
        _add_rms_norm,
        _add_rms_norm_fake,
    ),
    (
        "add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps, "
        "Tensor(b!) out) -> ()",
        _add_rms_norm_,
        _add_rms_norm_fake_,
    ),
    ("silu_mul(Tensor x) -> Tensor", _silu_mul, _silu_mul_fake),
    ("silu_mul.out(Tensor x, Tensor(a!) out) -> ()", _silu_mul_out, _silu_mul_out_fake),
    ("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", _rotary_, _rotary_fake_),
    (f"rotary_write_kv({_WRITE_KV}) -> Tensor", _rotary_write_kv, _rotary_write_kv_fake),
    (
        f"rotary_write_kv.out({_WRITE_KV}, Tensor(c!) q_out) -> ()",
        _rotary_write_kv_out,
        _rotary_write_kv_out_fake,
    ),
    (
        f"decode_layer_attention.out({_WRITE_KV}, Tensor block_tables, Tensor context_lens, "
        "float scale, int? sliding_window, Tensor(c!) q_out, Tensor(d!) out) -> ()",
        _decode_layer_attention_out,
        _decode_layer_attention_out_fake,
    ),
]


def _fake_on_cpu(name: str, fake: Callable) -> Callable:
    """The fake implementation, after the device check the CPU one needs not make."""
    base, _, overload = name.partition(".")
    schema = getattr(getattr(torch.ops.cadence, base), overload or "default")._schema
    names = [argument.name for argument in schema.arguments]

    def checked(*args):
        checks.on_cpu(name, names, args)
        return fake(*args)

    return checked


for _schema, _impl, _fake in _OPERATORS:
    _name = _schema[: _schema.index("(")]
    LIBRARY.define(_schema)
    LIBRARY.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"cadence::{_name}", _fake_on_cpu(_name, _fake), lib=LIBRARY)

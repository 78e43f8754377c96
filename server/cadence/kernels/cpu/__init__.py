"""C++ kernels for the shard's CPU path (`cpu_kernels.cpp` beside this file), with a
plain torch reference beside each (`*_ref`), which is what the tests compare against.

The source is compiled once per instruction set (`isa.ISAS`: AVX-512 with BF16, AVX-512,
AVX2 + FMA + F16C, portable scalar), each with its own explicit `-march`, by the
machine's C++ compiler (`$CXX`, default g++) with OpenMP, into
`~/.cache/cadence/kernels/` (or `$CADENCE_KERNEL_CACHE`), keyed by a hash of the source,
the flags and the compiler. `make install` builds every one ahead of time (`python -m
cadence.kernels.cpu`); a missing one is built on first use. Which one runs is decided
once, at start, from what the CPU reports (`select`, `--cpu-isa`, `$CADENCE_CPU_ISA`),
so a build made on one machine runs on another. One library per instruction set rather
than one binary holding all of them: the inline and template functions that each copy
instantiates (the standard library's among them) would otherwise be merged across
copies by the linker, and an AVX-512 instance could end up called on an AVX2 CPU.

Without a compiler `available()` is False and the shard keeps the torch backend. The
ctypes calls release the GIL; OpenMP is torch's own runtime (its libgomp is loaded
before this library).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from cadence.kernels.cpu import isa as isas
from cadence.kernels.reference import decode_attention_ref

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -fno-trapping-math: loops with a select or a min/max around fast_exp (greedy's sum, the
# generic SwiGLU) vectorize without AVX-512's masked stores (avx2 greedy: 1.5 -> 0.43 ms at
# 32 x 49152); no FP exception flag is ever read here.
BASE_FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None  # the selected instruction set's library
_selected: str | None = None
_loaded: dict[str, ctypes.CDLL] = {}
_error: str | None = None


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    configured = os.environ.get("CADENCE_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache/cadence/kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise KernelBuildError(f"no C++ compiler ({cxx!r} is not on PATH)")
    return path


def flags(isa: str) -> tuple[str, ...]:
    return (*BASE_FLAGS, *isas.compile_flags(isa))


def library_path(isa: str) -> Path:
    """Where the build of this source for `isa`, by this compiler, lives."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags(isa)).encode(), version.encode()):
        key.update(part)
    key.update(platform.machine().encode())
    return cache_dir() / f"cpu_kernels-{isa}-{key.hexdigest()[:16]}.so"


def build(isa: str) -> Path:
    """Compiles the kernels for `isa` unless this exact build exists; atomic (a temp file
    renamed into place), so concurrent shards never load a half-written library."""
    target = library_path(isa)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [_compiler(), *flags(isa), "-o", tmp, str(SOURCE)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise KernelBuildError(
                f"compiling {SOURCE.name} for {isa} failed:\n{done.stderr[-2000:]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "cadence_paged_decode_attention": [
            ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i32, i32, i32, i32, f32, i64, i32, i32, i32,
        ],
        "cadence_greedy_logprobs": [ptr, i64, i64, ptr, ptr, i32, i32],
        "cadence_rms_norm": [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32, i32],
        "cadence_silu_mul": [ptr, ptr, i64, i64, i32, i32],
        "cadence_rotary": [ptr, i64, i32, i32, i64, ptr, ptr, i32, i32],
        "cadence_rotary_write_kv": [
            ptr, i64, i64, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32,
        ],
        "cadence_decode_layer_attention": [
            ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i32, i32, i32, i32,
            f32, i64, i32, i32, i32,
        ],
    }  # fmt: skip
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = i32
    return lib


def library(isa: str) -> ctypes.CDLL:
    """The loaded library of `isa` (built first if needed); the CPU must run `isa`."""
    with _lock:
        if isa not in _loaded:
            lacking = isas.missing(isa)
            if lacking:
                raise isas.IsaError(f"this CPU cannot run the {isa} kernels: lacks {lacking}")
            try:
                _loaded[isa] = _bind(ctypes.CDLL(str(build(isa))))
            except OSError as e:
                raise KernelBuildError(f"loading the {isa} kernels failed: {e}") from e
        return _loaded[isa]


def select(requested: str | None = None) -> str:
    """Makes the kernels of `requested` ("auto", an instruction set, or None for
    $CADENCE_CPU_ISA) the ones every call below runs; returns the instruction set.
    Raises IsaError for one the CPU lacks, KernelBuildError when they cannot be built."""
    global _library, _selected, _error
    try:
        chosen = isas.resolve(requested)
        lib = library(chosen)
    except (KernelBuildError, isas.IsaError) as e:
        _error = str(e)
        raise
    _library, _selected, _error = lib, chosen, None
    return chosen


@contextmanager
def selected(isa: str) -> Iterator[str]:
    """Runs the block with the kernels of `isa` (tests of every path), then restores the
    previous choice."""
    previous = _selected
    select(isa)
    try:
        yield isa
    finally:
        select(previous)


def selected_isa() -> str | None:
    """The instruction set of the kernels in use (None before any is loaded)."""
    return _selected


def _load() -> ctypes.CDLL:
    if _library is not None:  # every layer of every step comes here: no lock once loaded
        return _library
    if _error is not None:
        raise KernelBuildError(_error)
    select()  # the instruction set of $CADENCE_CPU_ISA, else the best the CPU has
    assert _library is not None
    return _library


def available() -> bool:
    """True when the kernels are built (or build now) and load."""
    try:
        _load()
    except (KernelBuildError, isas.IsaError):
        return False
    return True


def enabled_for(t: torch.Tensor) -> bool:
    """Whether the shard's layers take the C++ path for this tensor: a CPU tensor of a
    supported dtype, the kernels built, and `CADENCE_CPU_KERNELS` not 0."""
    return (
        t.device.type == "cpu"
        and t.dtype in DTYPES
        and os.environ.get("CADENCE_CPU_KERNELS", "1") != "0"
        and available()
    )


def unavailable_reason() -> str | None:
    return None if available() else _error


def _check_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError("the CPU kernels take CPU tensors")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, heads, head_dim], one query per sequence at position context_lens - 1;
    caches [num_blocks, block_size, kv_heads, head_dim] (q's dtype, or either one
    float32); block_tables [B, >= blocks
    needed] int64 -> [B, heads, head_dim] in q's dtype. Keys and values are read through
    the block table in place; the query heads sharing a KV head are computed together."""
    _check_cpu(q, k_cache, v_cache, block_tables, context_lens)
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"unsupported dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype}")
    if q.dtype != k_cache.dtype and torch.float32 not in (q.dtype, k_cache.dtype):
        raise ValueError(f"no kernel for {q.dtype} queries over a {k_cache.dtype} cache")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64:
        raise ValueError("block_tables and context_lens must be int64")
    b, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    q = q.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor shaped and typed like q")
    if b == 0:
        return out
    status = _load().cadence_paged_decode_attention(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), b,
        heads, kv_heads, head_dim, block_size, scale, sliding_window or 0, DTYPES[q.dtype],
        DTYPES[k_cache.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cadence_paged_decode_attention failed with status {status}")
    return out


# The definition both kernel families are tested against (float32, sequence by sequence).
paged_decode_attention_ref = decode_attention_ref


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, vocab] float32 or bfloat16 -> (argmax ids [R] int64, their float32
    log-probabilities [R])."""
    _check_cpu(logits)
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2:
        raise ValueError("greedy_logprobs takes a 2-D float32 or bfloat16 tensor")
    logits = logits.contiguous()
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    if rows and vocab:
        _load().cadence_greedy_logprobs(
            logits.data_ptr(), rows, vocab, ids.data_ptr(), logprobs.data_ptr(),
            DTYPES[logits.dtype], torch.get_num_threads(),
        )  # fmt: skip
    return ids, logprobs


def greedy_logprobs_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    ids = logits.argmax(dim=-1)
    return ids, logits.log_softmax(dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Llama's RMSNorm of x [T, hidden] (of x + residual when given, which is returned as
    the new residual) in one pass: (normed, new residual or None)."""
    _check_cpu(x, weight)
    x = x.contiguous()
    rows, hidden = x.shape
    out = torch.empty_like(x)
    residual_out = None
    if residual is not None:
        residual = residual.contiguous()
        residual_out = torch.empty_like(x)
    status = _load().cadence_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(),
        weight.contiguous().data_ptr(), out.data_ptr(),
        None if residual_out is None else residual_out.data_ptr(), rows, hidden, eps,
        DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cadence_rms_norm failed with status {status}")
    return out, residual_out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU over a fused [T, 2 * inter] gate/up projection -> [T, inter]."""
    _check_cpu(x)
    x = x.contiguous()
    rows, width = x.shape
    out = torch.empty(rows, width // 2, dtype=x.dtype)
    status = _load().cadence_silu_mul(
        x.data_ptr(), out.data_ptr(), rows, width // 2, DTYPES[x.dtype], torch.get_num_threads()
    )
    if status != 0:
        raise RuntimeError(f"cadence_silu_mul failed with status {status}")
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies the rotary embedding in place to x [T, heads, head_dim] (rows may be a
    strided view into a fused QKV output); cos/sin [T, 1 or absent, head_dim] in x's dtype."""
    _check_cpu(x, cos, sin)
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("rotary_ needs each token's heads packed (stride head_dim, 1)")
    cos, sin = _cos_sin_rows(cos, sin, tokens, x.dtype)
    status = _load().cadence_rotary(
        x.data_ptr(), tokens, heads, head_dim, x.stride(0), cos.data_ptr(), sin.data_ptr(),
        DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cadence_rotary failed with status {status}")
    return x


def _check_fused_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> None:
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not a fused [T, (q|k|v) heads] output")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int):
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in DTYPES:
        raise ValueError(f"unsupported cache dtypes {k_cache.dtype}/{v_cache.dtype}")
    if tuple(k_cache.shape[2:]) != (kv_heads, head_dim) or k_cache.shape != v_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold {kv_heads} x {head_dim}")


def _cos_sin_rows(cos: torch.Tensor, sin: torch.Tensor, tokens: int, dtype: torch.dtype):
    cos = cos.reshape(tokens, -1).contiguous()
    sin = sin.reshape(tokens, -1).contiguous()
    if cos.dtype != dtype or sin.dtype != dtype:
        raise ValueError("cos and sin must be in the activations' dtype")
    return cos, sin


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
) -> torch.Tensor:
    """The first half of a Llama attention layer for T new tokens, in one pass over a
    fused QKV output qkv [T, (heads + 2 kv_heads) * head_dim]: the queries rotated into
    q_out [T, heads, head_dim] (returned), the keys rotated and the values copied into
    their slots of the paged caches [blocks, block_size, kv_heads, head_dim] (the cache
    may be another dtype). cos/sin: [T, (1,) head_dim] in qkv's dtype."""
    _check_cpu(qkv, cos, sin, k_cache, v_cache, slot_mapping)
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    _check_fused_qkv(qkv, heads, kv_heads, head_dim)
    _check_cache(k_cache, v_cache, kv_heads, head_dim)
    if qkv.dtype not in DTYPES or slot_mapping.dtype != torch.int64:
        raise ValueError("qkv must be float32/bfloat16/float16 and slot_mapping int64")
    cos, sin = _cos_sin_rows(cos, sin, tokens, qkv.dtype)
    slot_mapping = slot_mapping.contiguous()
    if q_out is None:
        q_out = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
    status = _load().cadence_rotary_write_kv(
        qkv.data_ptr(), tokens, qkv.stride(0), heads, kv_heads, head_dim, cos.data_ptr(),
        sin.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), DTYPES[qkv.dtype], DTYPES[k_cache.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cadence_rotary_write_kv failed with status {status}")
    return q_out


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

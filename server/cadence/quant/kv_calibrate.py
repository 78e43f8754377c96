"""Whether an int8 KV cache decodes faster than the activations' dtype on this machine,
measured, for quantized serving's default cache.

An int8 cache halves the bytes decode attention reads, but its values are converted to
the activations' dtype as they are read: on a Zen 4 the halved reads win (a decode step
of SmolLM2 at 32 rows and 400 tokens of context 44.4 -> 40.1 ms), on AVX2 kernels the
conversion costs more than the reads save. So it is measured with the kernel table
(`cadence.quant.calibrate`), once per machine key: the shard's paged decode attention over
SmolLM2-135M's 30 layers (9 query heads on 3 KV heads of 64) for DECODE_ROWS rows at
CONTEXT tokens, the charter workload's decode step, with each cache in its own blocks
(more than a CPU's caches hold: 30 layers x 32 x 400 tokens is 295 MB in bfloat16, so they
stream from memory as in a real step). int8 is chosen only when KV_MARGIN faster: it
moves logits more than a 16-bit cache (docs/quantization.md, "the margin rule"), which is
worth it only for a clear gain, and a choice that flipped with a shared machine's noise
would change answers from one start to the next.

Only quantized serving takes the measured choice (`cadence.launcher`): it already serves
quantized arithmetic under the margin rule; float weights keep a float cache by default.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

INT8 = "int8"
DECODE_ROWS, CONTEXT = 32, 400
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
KV_MARGIN = 1.05  # int8 must be this much faster to be chosen
REPEATS = 4  # timed passes per cache dtype, in turn with the other's (the fastest counts)


@dataclass(slots=True)
class KvMeasured:
    """Seconds per decode step's attention over every layer, by cache dtype, and the
    dtype chosen for quantized serving's default."""

    choice: str
    seconds: dict[str, float]
    measured_at: str = ""
    rows: int = DECODE_ROWS
    context: int = CONTEXT


def choose(seconds: dict[str, float], float_dtype: str) -> str:
    return INT8 if seconds[INT8] * KV_MARGIN < seconds[float_dtype] else float_dtype


def _attention_step(
    cache_dtype: str, dtype_name: str, rows: int, context: int
) -> Callable[[], None]:
    """One decode step's attention over every layer, `rows` rows at `context` tokens, over
    a `cache_dtype` cache of random keys and values (warmed once)."""
    import torch

    from cadence.kernels import cpu as cpu_kernels
    from cadence.kv_cache import KVCache

    dtype = getattr(torch, dtype_name)
    blocks_per_row = -(-context // BLOCK_SIZE)
    num_blocks = rows * blocks_per_row
    cache = KVCache(LAYERS, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, cache_dtype, "cpu")
    if cache.blocks.dtype == torch.int8:
        cache.blocks.copy_(torch.randint(-127, 128, cache.blocks.shape, dtype=torch.int8))
        assert cache.token_scales is not None
        cache.token_scales.uniform_(0.01, 0.05)
    else:
        cache.blocks.normal_()
    # each row's blocks spread over the pool, as a running batch's are after a while
    tables = torch.randperm(num_blocks).reshape(rows, blocks_per_row)
    lens = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def one_step() -> None:
        for layer in range(LAYERS):
            k, v = cache.layer(layer)
            k_scale, v_scale = cache.scales(layer)
            cpu_kernels.paged_decode_attention(
                q, k, v, tables, lens, scale, None, out=out, k_scale=k_scale, v_scale=v_scale
            )

    one_step()  # warm-up: first touches, the kernel's workspaces
    return one_step


def _fastest(steps: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Each step's fastest of REPEATS passes, the steps taken in turn (a moment's
    slowdown of a shared machine then falls on both sides, not on one)."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(REPEATS):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure(dtype_name: str, rows: int = DECODE_ROWS, context: int = CONTEXT) -> KvMeasured:
    """Times an int8 cache against one in `dtype_name` (the activations' dtype; a float32
    serve's cache is bfloat16, `cpu_isa.default_kv_cache_dtype`) with the C++ kernels
    already selected, at `rows` x `context` (the charter's decode step unless a test asks
    for less)."""
    from cadence.cpu_isa import default_kv_cache_dtype

    float_dtype = default_kv_cache_dtype("cpu", dtype_name)
    steps = {name: _attention_step(name, dtype_name, rows, context) for name in (float_dtype, INT8)}
    seconds = _fastest(steps)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return KvMeasured(choose(seconds, float_dtype), seconds, stamp, rows, context)


def describe(measured: KvMeasured) -> str:
    """ "int8 (bfloat16 13.7 / int8 12.6 ms of decode attention a step, measured ...)"."""
    times = " / ".join(f"{name} {s * 1e3:.1f}" for name, s in measured.seconds.items())
    return (
        f"{measured.choice} ({times} ms of attention for a decode step of {measured.rows} rows "
        f"at {measured.context} tokens; measured {measured.measured_at})"
    )

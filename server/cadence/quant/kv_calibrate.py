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

Where AMX-INT8 passes its self-test, the int8 cache's attention is timed on AMX tiles too
(attention_int8_amx.h, bitwise equal to the VNNI kernel, so the choice moves no answer),
for a decode step and for a prompt chunk's tokens (PROMPTS prompts of PROMPT_LEN tokens,
each token a query over the context up to itself, as batch-invariant prefill asks): the
tiles take the calls they win by TILES_MARGIN, every call (`tiles_min_rows` 1) or only a
prompt chunk's (PROMPT_ROWS: a call of at least 2 rows); 0: none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

INT8 = "int8"
DECODE_ROWS, CONTEXT = 32, 400
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
KV_MARGIN = 1.05  # int8 must be this much faster to be chosen
REPEATS = 4  # timed passes per cache dtype, in turn with the other's (the fastest counts)
PROMPTS, PROMPT_LEN = 3, 320  # the prompt chunk the tiles are timed on
TILES_MARGIN = 1.05  # the AMX tiles must be this much faster to take a kind of call
EVERY_CALL, PROMPT_ROWS = 1, 2  # tiles_min_rows: the tiles take every call, or a chunk's
VECTOR_TILES, AMX_TILES = 0, 1  # use_attention_tiles' codes


@dataclass(slots=True)
class KvMeasured:
    """Seconds per decode step's attention over every layer, by cache dtype, and the
    dtype chosen for quantized serving's default."""

    choice: str
    seconds: dict[str, float]
    measured_at: str = ""
    rows: int = DECODE_ROWS
    context: int = CONTEXT
    # the int8 cache's attention on AMX tiles: the calls of at least this many rows (0:
    # none), and the times it was chosen by ("decode vector", "decode amx", "prompt vector",
    # "prompt amx"; {}: not timed, `tiles_note` says why)
    tiles_min_rows: int = 0
    tiles_seconds: dict[str, float] = field(default_factory=dict)
    tiles_note: str = ""


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


def _prompt_step(dtype_name: str) -> Callable[[], None]:
    """The attention of PROMPTS prompts of PROMPT_LEN tokens over every layer, each token a
    query over its prompt up to itself (one block table per prompt), on an int8 cache."""
    import torch

    from cadence.kernels import cpu as cpu_kernels
    from cadence.kv_cache import KVCache

    blocks_per = -(-PROMPT_LEN // BLOCK_SIZE)
    num_blocks = PROMPTS * blocks_per
    cache = KVCache(LAYERS, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, INT8, "cpu")
    cache.blocks.copy_(torch.randint(-127, 128, cache.blocks.shape, dtype=torch.int8))
    assert cache.token_scales is not None
    cache.token_scales.uniform_(0.01, 0.05)
    order = torch.randperm(num_blocks).reshape(PROMPTS, blocks_per)
    tables = order.repeat_interleave(PROMPT_LEN, dim=0)
    lens = torch.arange(1, PROMPT_LEN + 1, dtype=torch.int64).repeat(PROMPTS)
    q = torch.randn(PROMPTS * PROMPT_LEN, HEADS, HEAD_DIM).to(getattr(torch, dtype_name))
    out = torch.empty_like(q)

    def one_pass() -> None:
        for layer in range(LAYERS):
            k, v = cache.layer(layer)
            k_scale, v_scale = cache.scales(layer)
            cpu_kernels.paged_decode_attention(
                q, k, v, tables, lens, HEAD_DIM**-0.5, None, out=out, k_scale=k_scale,
                v_scale=v_scale,
            )  # fmt: skip

    one_pass()
    return one_pass


def _on_tiles(step: Callable[[], None], tiles: int) -> Callable[[], None]:
    """`step` with the int8 cache's attention on `tiles` (then the vector code again)."""
    import torch

    def run() -> None:
        torch.ops.cadence.use_attention_tiles(tiles, 1)
        try:
            step()
        finally:
            torch.ops.cadence.use_attention_tiles(VECTOR_TILES, 1)

    return run


def choose_tiles(seconds: dict[str, float]) -> int:
    """tiles_min_rows from the four times: every call where the tiles win a decode step,
    a prompt chunk's calls where they win only those, else none."""
    if seconds["decode amx"] * TILES_MARGIN < seconds["decode vector"]:
        return EVERY_CALL
    if seconds["prompt amx"] * TILES_MARGIN < seconds["prompt vector"]:
        return PROMPT_ROWS
    return 0


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


def measure(
    dtype_name: str,
    rows: int = DECODE_ROWS,
    context: int = CONTEXT,
    amx: tuple[bool, str] | None = None,
) -> KvMeasured:
    """Times an int8 cache against one in `dtype_name` (the activations' dtype; a float32
    serve's cache is bfloat16, `cpu_isa.default_kv_cache_dtype`) with the C++ kernels
    already selected, at `rows` x `context` (the charter's decode step unless a test asks
    for less); `amx`: `calibrate.amx_usable`'s answer, (True, ...) to time the int8 cache's
    attention on AMX tiles too."""
    import torch

    from cadence.cpu_isa import default_kv_cache_dtype

    float_dtype = default_kv_cache_dtype("cpu", dtype_name)
    steps = {name: _attention_step(name, dtype_name, rows, context) for name in (float_dtype, INT8)}
    tiles_s: dict[str, float] = {}
    note = amx[1] if amx else ""
    granted = bool(amx and amx[0]) and bool(torch.ops.cadence.amx_available())
    if amx and amx[0] and not granted:
        note = "AMX tiles not timed: the kernel refused AMX permission"
    if granted and dtype_name in ("bfloat16", "float16"):  # the int8 kernel's query dtypes
        prompt = _prompt_step(dtype_name)
        steps |= {
            "decode amx": _on_tiles(steps[INT8], AMX_TILES),
            "prompt vector": prompt,
            "prompt amx": _on_tiles(prompt, AMX_TILES),
        }
    elif granted:
        note = f"AMX tiles not timed: {dtype_name} queries keep the vector kernel"
    seconds = _fastest(steps)
    if len(steps) > 2:
        tiles_s = {"decode vector": seconds[INT8]} | {
            name: seconds.pop(name) for name in ("decode amx", "prompt vector", "prompt amx")
        }
    min_rows = choose_tiles(tiles_s) if tiles_s else 0
    if min_rows == EVERY_CALL:  # the int8 cache decodes on the tiles
        seconds[INT8] = tiles_s["decode amx"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return KvMeasured(
        choose(seconds, float_dtype), seconds, stamp, rows, context, min_rows, tiles_s, note
    )


def tiles_text(measured: KvMeasured) -> str:
    """What the AMX tiles serve of the int8 cache's attention, and the times why."""
    if not measured.tiles_seconds:
        return measured.tiles_note
    t = {name: s * 1e3 for name, s in measured.tiles_seconds.items()}
    serves = {EVERY_CALL: "every call", PROMPT_ROWS: "prompt chunks' calls", 0: "no call"}
    return (
        f"int8 attention on AMX-INT8 tiles for {serves[measured.tiles_min_rows]} (decode step "
        f"vector {t['decode vector']:.1f} / AMX {t['decode amx']:.1f} ms, {PROMPTS} prompts of "
        f"{PROMPT_LEN} tokens {t['prompt vector']:.1f} / {t['prompt amx']:.1f} ms)"
    )


def describe(measured: KvMeasured) -> str:
    """ "int8 (bfloat16 13.7 / int8 12.6 ms of decode attention a step, measured ...)", and
    what the AMX tiles serve where they were timed."""
    times = " / ".join(f"{name} {s * 1e3:.1f}" for name, s in measured.seconds.items())
    tiles = tiles_text(measured)
    return (
        f"{measured.choice} ({times} ms of attention for a decode step of {measured.rows} rows "
        f"at {measured.context} tokens; measured {measured.measured_at})"
        + (f"; {tiles}" if tiles else "")
    )

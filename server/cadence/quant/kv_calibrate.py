"""Whether an int8 KV cache serves attention faster than the activations' dtype on this
machine, measured, for quantized serving's default cache.

An int8 cache halves the bytes decode attention reads, but its values are converted to
the activations' dtype as they are read: a decode step's 32 rows each read their own
sequence, a prompt's 320 tokens each read the prompt up to themselves, and how often a
prompt's blocks are converted depends on the kernel (once for every 8 or 16 rows of a
prompt chunk on the AVX-512 BF16 and AVX2 kernels). So both are timed, with the kernel
table (`cadence.quant.calibrate`), once per machine key, and weighed as the charter
workload mixes them (DECODE_WEIGHT decode steps per prompt, as the products are): the
shard's paged attention over SmolLM2-135M's 30 layers (9 query heads on 3 KV heads of
64) for a decode step of DECODE_ROWS rows at CONTEXT tokens, with each cache in its own
blocks (more than a CPU's caches hold: 30 layers x 32 x 400 tokens is 295 MB in
bfloat16, so they stream from memory as in a real step), and for PROMPTS prompts of
PROMPT_LEN tokens, each token a query over its prompt up to itself, as batch-invariant
prefill attends. On a 2-core Zen 3 (AVX2 kernels), while its kernel scaled an int8
block's rows again for each row of a prompt, int8 won the decode step (28.3 against 30.5
ms) and lost the prompts (90.2 against 56.7 ms a prompt), and the charter workload was
slower with it in two of three alternated rounds: timed on the decode step alone, the
choice was int8. int8 is chosen only when KV_MARGIN faster: it moves logits more than a 16-bit
cache (docs/quantization.md, "the margin rule"), which is worth it only for a clear
gain, and a choice that flipped with a shared machine's noise would change answers from
one start to the next.

Only quantized serving takes the measured choice (`cadence.launcher`): it already serves
quantized arithmetic under the margin rule; float weights keep a float cache by default.

Where AMX-INT8 passes its self-test, the int8 cache's attention is timed on AMX tiles too
(attention_int8_amx.h, bitwise equal to the VNNI kernel, so the choice moves no answer),
for the decode step and for the prompts: the tiles take the calls they win by TILES_MARGIN,
every call (`tiles_min_rows` 1) or only a prompt chunk's (PROMPT_ROWS: a call of at least 2
rows); 0: none. Where they win the decode step and lose the prompts, every call goes to
them only if that wins in the same mix. The int8 cache is then weighed on what serves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where they are used: the launcher reads the table without torch
    import torch

    from cadence.kv_cache import KVCache

INT8 = "int8"
DECODE_ROWS, CONTEXT = 32, 400
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
KV_MARGIN = 1.05  # int8 must be this much faster to be chosen
REPEATS = 4  # timed passes per cache dtype, in turn with the other's (the fastest counts)
PROMPTS, PROMPT_LEN = 3, 320  # the prompts timed in one pass
# The charter workload's mix: 64 prompts of 320 tokens and ~9,200 tokens decoded 32 at a
# time, 288 decode steps to 64 prompts (`calibrate.mix` weighs the products so too).
DECODE_WEIGHT = 4.5
CHARTER = (DECODE_ROWS, CONTEXT, PROMPT_LEN)  # what `measure` times by default
TILES_MARGIN = 1.05  # the AMX tiles must be this much faster to take a kind of call
EVERY_CALL, PROMPT_ROWS = 1, 2  # tiles_min_rows: the tiles take every call, or a chunk's
VECTOR_TILES, AMX_TILES = 0, 1  # use_attention_tiles' codes


@dataclass(slots=True)
class KvMeasured:
    """Seconds of attention over every layer, by cache dtype: a decode step's (`seconds`)
    and a prompt's (`prompt_seconds`), and the dtype chosen for quantized serving's
    default."""

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
    # one prompt of `prompt_len` tokens ({} in a table written before prompts were timed:
    # its choice saw the decode step alone, and is measured again)
    prompt_seconds: dict[str, float] = field(default_factory=dict)
    prompt_len: int = PROMPT_LEN


def mix(decode_s: float, prompt_s: float) -> float:
    """Attention's cost in the charter workload's proportions."""
    return DECODE_WEIGHT * decode_s + prompt_s


def choose(seconds: dict[str, float], prompt_seconds: dict[str, float], float_dtype: str) -> str:
    """int8 where its decode steps and prompts, mixed as the charter's, take KV_MARGIN
    less time than the float cache's."""
    cost = {name: mix(seconds[name], prompt_seconds[name]) for name in (INT8, float_dtype)}
    return INT8 if cost[INT8] * KV_MARGIN < cost[float_dtype] else float_dtype


def _random_cache(cache_dtype: str, num_blocks: int) -> KVCache:
    """A `cache_dtype` cache of SmolLM2's shape holding random keys and values."""
    import torch

    from cadence.kv_cache import KVCache

    cache = KVCache(LAYERS, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, cache_dtype, "cpu")
    if cache.blocks.dtype == torch.int8:
        cache.blocks.copy_(torch.randint(-127, 128, cache.blocks.shape, dtype=torch.int8))
        assert cache.token_scales is not None
        cache.token_scales.uniform_(0.01, 0.05)
    else:
        cache.blocks.normal_()
    return cache


def _every_layer(
    cache: KVCache, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> Callable[[], None]:
    """The shard's paged attention of `q` over every layer of `cache` (run once, to warm
    it: first touches, the kernel's workspaces)."""
    from cadence.kernels import cpu as cpu_kernels

    out = q.new_empty(q.shape)

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


def _attention_step(
    cache_dtype: str, dtype_name: str, rows: int, context: int
) -> Callable[[], None]:
    """One decode step's attention over every layer, `rows` rows at `context` tokens."""
    import torch

    blocks_per_row = -(-context // BLOCK_SIZE)
    num_blocks = rows * blocks_per_row
    cache = _random_cache(cache_dtype, num_blocks)
    # each row's blocks spread over the pool, as a running batch's are after a while
    tables = torch.randperm(num_blocks).reshape(rows, blocks_per_row)
    lens = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(getattr(torch, dtype_name))
    return _every_layer(cache, q, tables, lens)


def _prompt_step(cache_dtype: str, dtype_name: str, prompt_len: int) -> Callable[[], None]:
    """The attention of PROMPTS prompts of `prompt_len` tokens over every layer, each token
    a query over its prompt up to itself (one block table per prompt)."""
    import torch

    blocks_per = -(-prompt_len // BLOCK_SIZE)
    num_blocks = PROMPTS * blocks_per
    cache = _random_cache(cache_dtype, num_blocks)
    order = torch.randperm(num_blocks).reshape(PROMPTS, blocks_per)
    tables = order.repeat_interleave(prompt_len, dim=0)
    lens = torch.arange(1, prompt_len + 1, dtype=torch.int64).repeat(PROMPTS)
    q = torch.randn(PROMPTS * prompt_len, HEADS, HEAD_DIM).to(getattr(torch, dtype_name))
    return _every_layer(cache, q, tables, lens)


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
    """tiles_min_rows from the four times (the prompts' for PROMPTS prompts): every call
    where the tiles win both kinds by TILES_MARGIN, a prompt chunk's calls where they win
    only those; where they win only the decode step (they cannot take it alone), every
    call if that still wins by the margin in the charter's mix, else none."""
    decode = seconds["decode amx"] * TILES_MARGIN < seconds["decode vector"]
    prompt = seconds["prompt amx"] * TILES_MARGIN < seconds["prompt vector"]
    if prompt:
        return EVERY_CALL if decode else PROMPT_ROWS
    if not decode:
        return 0

    def cost(side: str) -> float:
        return mix(seconds[f"decode {side}"], seconds[f"prompt {side}"] / PROMPTS)

    return EVERY_CALL if cost("amx") * TILES_MARGIN < cost("vector") else 0


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
    prompt_len: int = PROMPT_LEN,
    amx: tuple[bool, str] | None = None,
) -> KvMeasured:
    """Times an int8 cache against one in `dtype_name` (the activations' dtype; a float32
    serve's cache is bfloat16, `cpu_isa.default_kv_cache_dtype`) with the C++ kernels
    already selected: a decode step of `rows` x `context` and PROMPTS prompts of
    `prompt_len` tokens (the charter's unless a test asks for less); `amx`:
    `calibrate.amx_usable`'s answer, (True, ...) to time the int8 cache's attention on
    AMX tiles too."""
    import torch

    from cadence.cpu_isa import default_kv_cache_dtype

    float_dtype = default_kv_cache_dtype("cpu", dtype_name)
    caches = (float_dtype, INT8)
    steps = {name: _attention_step(name, dtype_name, rows, context) for name in caches}
    prompts = {f"prompt {name}": _prompt_step(name, dtype_name, prompt_len) for name in caches}
    steps |= prompts
    tiles_s: dict[str, float] = {}
    note = amx[1] if amx else ""
    granted = bool(amx and amx[0]) and bool(torch.ops.cadence.amx_available())
    if amx and amx[0] and not granted:
        note = "AMX tiles not timed: the kernel refused AMX permission"
    if granted and dtype_name in ("bfloat16", "float16"):  # the int8 kernel's query dtypes
        steps |= {
            "decode amx": _on_tiles(steps[INT8], AMX_TILES),
            "prompt amx": _on_tiles(prompts[f"prompt {INT8}"], AMX_TILES),
        }
    elif granted:
        note = f"AMX tiles not timed: {dtype_name} queries keep the vector kernel"
    timed = _fastest(steps)
    seconds = {name: timed[name] for name in caches}
    passes = {name: timed[f"prompt {name}"] for name in caches}
    if "decode amx" in timed:
        tiles_s = {
            "decode vector": seconds[INT8],
            "decode amx": timed["decode amx"],
            "prompt vector": passes[INT8],
            "prompt amx": timed["prompt amx"],
        }
    min_rows = choose_tiles(tiles_s) if tiles_s else 0
    if min_rows == EVERY_CALL:  # the int8 cache decodes on the tiles
        seconds[INT8] = tiles_s["decode amx"]
    if min_rows in (EVERY_CALL, PROMPT_ROWS):  # and its prompts
        passes[INT8] = tiles_s["prompt amx"]
    prompt_s = {name: s / PROMPTS for name, s in passes.items()}
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    choice = choose(seconds, prompt_s, float_dtype)
    return KvMeasured(
        choice, seconds, stamp, rows, context, min_rows, tiles_s, note, prompt_s, prompt_len
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
        f"{measured.prompt_len} tokens {t['prompt vector']:.1f} / {t['prompt amx']:.1f} ms)"
    )


def describe(measured: KvMeasured) -> str:
    """ "bfloat16 (attention of a decode step of 32 rows at 400 tokens: bfloat16 30.5 /
    int8 28.3 ms; of a prompt of 320 tokens: bfloat16 56.7 / int8 90.2 ms; 4.5 decode steps
    a prompt, as the charter workload mixes them; measured ...)", and what the AMX tiles
    serve where they were timed."""

    def times(seconds: dict[str, float]) -> str:
        return " / ".join(f"{name} {s * 1e3:.1f}" for name, s in seconds.items())

    what = f"attention of a decode step of {measured.rows} rows at {measured.context} tokens"
    what += f": {times(measured.seconds)} ms"
    if measured.prompt_seconds:
        what += f"; of a prompt of {measured.prompt_len} tokens: "
        what += f"{times(measured.prompt_seconds)} ms; {DECODE_WEIGHT:g} decode steps a prompt, "
        what += "as the charter workload mixes them"
    text = f"{measured.choice} ({what}; measured {measured.measured_at})"
    tiles = tiles_text(measured)
    return f"{text}; {tiles}" if tiles else text

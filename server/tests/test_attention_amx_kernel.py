"""Attention over an int8 KV cache on AMX-INT8 tiles (attention_int8_amx.h, switched on by
`torch.ops.cadence.use_attention_tiles`): the VNNI vector kernel's result bit for bit, for
decode rows and for a prompt chunk's tokens, so the tiles can serve any call without moving
an answer (batch invariance ties a prompt token's attention to the decode kernel's
arithmetic); and the kernel table's choice of where they serve, taken by a shard. Emulated
tiles (`amx_tiles.h`) wherever the avx512_bf16 kernels run; the hardware's where the CPU
and Linux allow AMX-INT8, skipped with the reason elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cadence.kernels import cpu
from cadence.kernels.cpu import amx_check
from cadence.kv_cache import KVCache
from cadence.quant import calibrate, kv_calibrate, setup

VECTOR, HARDWARE, EMULATED = 0, 1, 2


@pytest.fixture(params=[EMULATED, HARDWARE], ids=["emulated", "hardware"])
def tiles(request: pytest.FixtureRequest, avx512_bf16: None) -> int:
    if request.param == HARDWARE:
        request.getfixturevalue("amx_int8_hardware")
    return request.param


@pytest.fixture
def vector_afterwards(avx512_bf16: None) -> Iterator[None]:
    """Whatever a test sets, the vector kernel serves the next one."""
    yield
    torch.ops.cadence.use_attention_tiles(VECTOR, 1)


def _cache(blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int) -> KVCache:
    """An int8 cache of random codes and scales, the scales of every slot NaN first: a slot
    no query sees keeps them (the kernels must never read them)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, blocks, block_size, kv_heads, head_dim, "int8", "cpu")
    codes = torch.randint(-127, 128, cache.blocks.shape, dtype=torch.int8, generator=g)
    cache.blocks.copy_(codes)
    assert cache.token_scales is not None
    cache.token_scales.fill_(float("nan"))
    return cache


def _attend(cache: KVCache, q, tables, lens, window, tiles: int, min_rows: int = 1):
    torch.ops.cadence.use_attention_tiles(tiles, min_rows)
    k, v = cache.layer(0)
    k_scale, v_scale = cache.scales(0)
    out = torch.full_like(q, float("nan"))
    cpu.paged_decode_attention(
        q, k, v, tables, lens, q.shape[-1] ** -0.5, window, out=out, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    return out


def _seen_scales(cache: KVCache, tables: torch.Tensor, lens: torch.Tensor, seed: int) -> None:
    """Finite scales for the slots some row sees (the others stay NaN)."""
    block_size = cache.blocks.shape[-3]
    seen = []
    for table, n in zip(tables, lens.tolist(), strict=True):
        pos = torch.arange(n)
        seen.append(table[pos // block_size] * block_size + pos % block_size)
    slots = torch.unique(torch.cat(seen))
    scales = cache.token_scales
    assert scales is not None
    flat = scales.view(2, -1, scales.shape[-1])  # one layer: [2, slots, kv_heads]
    g = torch.Generator().manual_seed(seed)
    flat[:, slots] = torch.rand(2, len(slots), scales.shape[-1], generator=g) * 0.04 + 0.01


# (query heads, KV heads, head_dim, block size): SmolLM2's 9 on 3 KV heads of 64; one
# query head a KV head; 24 on 2 (a KV head's heads past one 16-row tile); 128 and 256 dims
DECODE_LENS = [1, 15, 16, 17, 64, 255, 256, 257, 300, 513]
SHAPES = [(9, 3, 64, 16), (4, 4, 64, 32), (24, 2, 64, 16), (32, 8, 128, 64), (16, 1, 256, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_rows_on_the_tiles_are_the_vector_kernels_bit_for_bit(
    shape, dtype, tiles, vector_afterwards
):
    heads, kv_heads, head_dim, block_size = shape
    per_row = -(-max(DECODE_LENS) // block_size)
    blocks = len(DECODE_LENS) * per_row + 3
    cache = _cache(blocks, block_size, kv_heads, head_dim, seed=heads)
    g = torch.Generator().manual_seed(1)
    tables = torch.randperm(blocks, generator=g)[: len(DECODE_LENS) * per_row]
    tables = tables.view(len(DECODE_LENS), per_row)
    lens = torch.tensor(DECODE_LENS)
    _seen_scales(cache, tables, lens, seed=2)
    q = (torch.randn(len(lens), heads, head_dim, generator=g) * 4).to(dtype)
    for window in (None, 40):
        want = _attend(cache, q, tables, lens, window, VECTOR)
        got = _attend(cache, q, tables, lens, window, tiles)
        assert torch.equal(got, want), (window, float((got.float() - want.float()).abs().max()))
        ref = cpu.paged_decode_attention_ref(
            q, *cache.layer(0), tables, lens, head_dim**-0.5, window, *cache.scales(0)
        )
        tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
        assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_a_prompt_chunks_tokens_on_the_tiles_are_the_vector_kernels_bit_for_bit(
    shape, tiles, vector_afterwards
):
    """Two prompts' tokens, each a query over its prompt up to itself (one block table per
    prompt, consecutive rows: calls of up to 16 rows on the tiles, 8 on the vector code),
    across a 256-position softmax chunk; and a decode row between them."""
    heads, kv_heads, head_dim, block_size = shape
    lengths = (300, 37)
    per_prompt = -(-max(lengths) // block_size)
    blocks = 3 * per_prompt + 3
    cache = _cache(blocks, block_size, kv_heads, head_dim, seed=3)
    g = torch.Generator().manual_seed(4)
    order = torch.randperm(blocks, generator=g)[: 3 * per_prompt].view(3, per_prompt)
    rows, lens = [], []
    for p, n in enumerate(lengths):
        rows += [order[p]] * n
        lens += range(1, n + 1)
        if p == 0:  # a decode row of another sequence
            rows.append(order[2])
            lens.append(200)
    tables, lens = torch.stack(rows), torch.tensor(lens)
    _seen_scales(cache, tables, lens, seed=5)
    q = (torch.randn(len(lens), heads, head_dim, generator=g) * 4).to(torch.bfloat16)
    want = _attend(cache, q, tables, lens, None, VECTOR)
    for min_rows in (1, kv_calibrate.PROMPT_ROWS):
        got = _attend(cache, q, tables, lens, None, tiles, min_rows)
        assert torch.equal(got, want), min_rows


def test_the_setting_is_checked_and_returned(avx512_bf16, vector_afterwards):
    op = torch.ops.cadence.use_attention_tiles
    assert op(EMULATED, 2) == (VECTOR, 1)
    assert op(VECTOR, 1) == (EMULATED, 2)
    with pytest.raises(ValueError, match="tiles"):
        op(3, 1)
    with pytest.raises(ValueError, match="min_rows"):
        op(EMULATED, 0)


def test_hardware_tiles_without_amx_are_an_error_not_a_crash(avx512_bf16, vector_afterwards):
    if torch.ops.cadence.amx_available():
        pytest.skip("this process may run AMX-INT8 (the hardware cases run instead)")
    with pytest.raises(RuntimeError, match="AMX is not usable"):
        torch.ops.cadence.use_attention_tiles(HARDWARE, 1)
    assert torch.ops.cadence.use_attention_tiles(VECTOR, 1) == (VECTOR, 1)


def test_only_the_avx512_bf16_kernels_have_the_tiles():
    from cadence import cpu_isa

    others = [isa for isa in cpu_isa.supported() if isa not in ("avx512_bf16", "scalar")]
    if not others:
        pytest.skip("no other kernels with a C++ build run on this CPU")
    for isa in others:
        with cpu.selected(isa):
            assert torch.ops.cadence.use_attention_tiles(VECTOR, 1) == (VECTOR, 1)
            with pytest.raises(RuntimeError, match="no AMX kernel"):
                torch.ops.cadence.use_attention_tiles(EMULATED, 1)


def test_the_tiles_take_the_calls_they_win_by_the_margin():
    def times(decode_amx: float, prompt_amx: float) -> dict[str, float]:
        prompts = kv_calibrate.PROMPTS  # the prompts' times are for that many
        return {"decode vector": 1.0, "decode amx": decode_amx, "prompt vector": prompts,
                "prompt amx": prompt_amx * prompts}  # fmt: skip

    assert kv_calibrate.choose_tiles(times(0.9, 0.9)) == kv_calibrate.EVERY_CALL
    assert kv_calibrate.choose_tiles(times(0.8, 1.2)) == kv_calibrate.EVERY_CALL
    # the decode step won by less than the prompts lose, in the charter's mix: vector
    assert kv_calibrate.choose_tiles(times(0.9, 1.2)) == 0
    assert kv_calibrate.choose_tiles(times(1.1, 0.7)) == kv_calibrate.PROMPT_ROWS
    assert kv_calibrate.choose_tiles(times(0.99, 0.5)) == kv_calibrate.PROMPT_ROWS
    assert kv_calibrate.choose_tiles(times(0.97, 0.97)) == 0  # within the margin: vector
    assert kv_calibrate.choose_tiles(times(1.2, 1.3)) == 0
    # a Sapphire Rapids (family 6 model 167): decode 14.3 / 14.1 ms, prompts 61.4 / 42.3
    on_spr = {"decode vector": 14.3, "decode amx": 14.1, "prompt vector": 61.4, "prompt amx": 42.3}
    assert kv_calibrate.choose_tiles(on_spr) == kv_calibrate.PROMPT_ROWS


def test_the_measurement_times_the_tiles_where_amx_passes_its_self_test(avx512_bf16):
    amx = calibrate.amx_usable(amx_check.ISA)
    measured = kv_calibrate.measure("bfloat16", rows=2, context=40, prompt_len=32, amx=amx)
    if not (amx[0] and torch.ops.cadence.amx_available()):
        assert measured.tiles_min_rows == 0 and not measured.tiles_seconds
        assert "AMX tiles not timed" in measured.tiles_note
        return
    assert set(measured.tiles_seconds) == {
        "decode vector", "decode amx", "prompt vector", "prompt amx"
    }  # fmt: skip
    assert measured.tiles_min_rows == kv_calibrate.choose_tiles(measured.tiles_seconds)
    if measured.tiles_min_rows:  # the int8 cache's prompts weighed on the tiles that serve them
        on_tiles = measured.tiles_seconds["prompt amx"] / kv_calibrate.PROMPTS
        assert measured.prompt_seconds["int8"] == on_tiles
    assert "AMX-INT8 tiles" in kv_calibrate.describe(measured)
    assert torch.ops.cadence.use_attention_tiles(VECTOR, 1) == (VECTOR, 1)  # left as found


def _table_choosing_tiles(path: Path, min_rows: int) -> str:
    seconds = {"decode vector": 1.0, "decode amx": 0.5, "prompt vector": 1.0, "prompt amx": 0.5}
    halved = {"bfloat16": 1.0, "int8": 0.5}
    kv = kv_calibrate.KvMeasured("int8", halved, "now", tiles_min_rows=min_rows,
                                 tiles_seconds=seconds, prompt_seconds=halved)  # fmt: skip
    key = calibrate.machine_key(amx_check.ISA, "bfloat16")
    calibrate.write(calibrate.KernelTable(key, kv_cache=kv), path)
    return str(path)


@pytest.mark.parametrize("min_rows", [kv_calibrate.EVERY_CALL, kv_calibrate.PROMPT_ROWS])
def test_a_shard_serves_an_int8_cache_on_the_tiles_the_table_chose_with_the_same_logits(
    min_rows, tiles, model_dirs, engine_for, tmp_path, monkeypatch, vector_afterwards
):
    """A bfloat16 model with an int8 cache and a table choosing the tiles: /info says so,
    and prefill and decode logits are the vector kernel's bit for bit. Emulated: the shard
    asks for the emulated tiles where it would ask for AMX's (same kernel, in software)."""
    from shard_helpers import prefill_then_decode_logits

    if tiles == EMULATED:
        monkeypatch.setattr(kv_calibrate, "AMX_TILES", EMULATED)
        monkeypatch.setattr(setup, "amx_available", lambda: True)
    tokens = [5, 17, 42, 9, 77, 3, 120, 64, 8, 33, 91, 12, 250, 6, 19, 28, 200, 1, 44, 70]
    model_dir = model_dirs("llama_head_dim_64")
    plain = engine_for(model_dir, dtype="bfloat16", kv_cache_dtype="int8")
    assert plain.attention_tiles_measured == ""
    want = prefill_then_decode_logits(plain, tokens, 12)
    table = _table_choosing_tiles(tmp_path / "table.json", min_rows)
    served = engine_for(model_dir, dtype="bfloat16", kv_cache_dtype="int8", kernel_table=table)
    assert "AMX-INT8 tiles" in served.quantization_fields()["kv_cache_attention"]
    assert torch.ops.cadence.use_attention_tiles(tiles, min_rows) == (tiles, min_rows)
    got = prefill_then_decode_logits(served, tokens, 12)
    assert torch.equal(got, want)
    bf16_cache = engine_for(model_dir, dtype="bfloat16", kernel_table=table)
    assert bf16_cache.attention_tiles_measured == ""  # a bfloat16 cache: nothing to serve
    assert torch.ops.cadence.use_attention_tiles(VECTOR, 1) == (VECTOR, 1)

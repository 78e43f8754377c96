"""The C++ CPU kernels (`cadence.kernels.cpu`) against their torch references: random
paged caches over shuffled blocks, several block sizes, head dims, GQA ratios, ragged
lengths including 1 and block boundaries, sliding windows, every dtype pairing the
shard uses; outputs are poisoned before each run so unwritten elements fail. Every test
runs once per instruction set of the kernels (the `cpu_isa` fixture: AVX-512 BF16,
AVX-512, AVX2, scalar), the ones this CPU lacks skipped."""

from __future__ import annotations

import pytest
import torch
from cadence.kernels import cpu
from cadence.layers.kernel_ops import TORCH_OPS, LayerOps, bind, cpu_ops
from kernel_cases import assert_close, paged_cache, poisoned, quantized_cache

pytestmark = pytest.mark.usefixtures("cpu_isa")

LENS = [1, 15, 16, 17, 33, 64, 130]  # one token, around block boundaries, longer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_paged_decode_attention_matches_reference(dtype, block_size, heads, kv_heads, head_dim):
    k_cache, v_cache, tables = paged_cache(
        LENS, block_size, kv_heads, head_dim, dtype, seed=block_size + heads + head_dim
    )
    k_cache, v_cache, tables = k_cache.cpu(), v_cache.cpu(), tables.cpu().long()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(len(LENS), heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(LENS)
    scale = head_dim**-0.5
    for window in (None, 20):
        out = poisoned(tuple(q.shape), dtype).cpu()
        cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, out=out)
        ref = cpu.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale, window)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
def test_paged_decode_attention_with_a_cache_of_another_dtype(q_dtype, kv_dtype):
    k_cache, v_cache, tables = paged_cache(LENS, 16, 3, 64, kv_dtype, seed=3)
    k_cache, v_cache, tables = k_cache.cpu(), v_cache.cpu(), tables.cpu().long()
    q = torch.randn(len(LENS), 9, 64, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    lens = torch.tensor(LENS)
    out = poisoned(tuple(q.shape), q_dtype).cpu()
    cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out)
    ref = cpu.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    assert_close(out, ref, torch.bfloat16 if torch.float32 != q_dtype else kv_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("garbage", [1e4, float("nan")])
def test_paged_decode_attention_reads_only_the_table_rows_it_owns(dtype, garbage):
    """Blocks of other sequences, and the slots of a sequence's last block past its
    length, hold huge values or NaN: reading or weighting one would show. (bfloat16 takes
    the AVX512-BF16 path where the CPU has it, which scores whole 16-row blocks.)"""
    k_cache, v_cache, tables = paged_cache([20, 5], 16, 2, 64, dtype, seed=5)
    k_cache, v_cache, tables = k_cache.cpu(), v_cache.cpu(), tables.cpu().long()
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    owned = set(tables[0, :2].tolist()) | {int(tables[1, 0])}
    for block in range(k_cache.shape[0]):
        if block not in owned:
            k_cache[block] = garbage
            v_cache[block] = garbage
    k_cache[tables[0, 1], 4:] = garbage  # slots past the first sequence's 20 tokens
    v_cache[tables[0, 1], 4:] = garbage
    k_cache[tables[1, 0], 5:] = garbage  # and past the second's 5
    v_cache[tables[1, 0], 5:] = garbage
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    lens = torch.tensor([20, 5])
    out = cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.isfinite(out).all() and out.abs().max() < 10
    ref = cpu.paged_decode_attention_ref(q, clean_k, clean_v, tables, lens, 0.125)
    assert_close(out, ref, dtype)  # as if the garbage were not there


QUANTIZED = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "head_dim"), [(16, 9, 3, 64),
                         (8, 4, 4, 128), (32, 16, 2, 80), (16, 4, 2, 48), (32, 16, 2, 96),
                         (16, 8, 1, 256)])  # fmt: skip
def test_paged_decode_attention_over_a_quantized_cache_matches_reference(
    kv_dtype, dtype, block_size, heads, kv_heads, head_dim
):
    """The kernel reads an int8 or fp8 cache with its scales as the reference reads it
    (in float32, the elements times their scales); head_dim 48 takes the generic path
    on every instruction set, 80 the AVX2 one on AVX-512 BF16 too (whose vdpbf16ps path
    takes multiples of 32: blocks of 16 a row at a time, others a row at a time, 8
    query heads per KV head in passes of 3 at head_dim 96)."""
    k_float, v_float, tables = paged_cache(LENS, block_size, kv_heads, head_dim, torch.float32, 9)
    (k_cache, k_scale), (v_cache, v_scale) = (
        quantized_cache(k_float.cpu() * 3, kv_dtype),
        quantized_cache(v_float.cpu(), kv_dtype),
    )
    tables = tables.cpu().long()
    q = torch.randn(len(LENS), heads, head_dim, generator=torch.Generator().manual_seed(7))
    q = q.to(dtype)
    lens = torch.tensor(LENS)
    for window in (None, 20):
        out = poisoned(tuple(q.shape), dtype).cpu()
        cpu.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, out=out,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        ref = cpu.paged_decode_attention_ref(
            q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, k_scale, v_scale
        )
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 8])
def test_paged_decode_attention_over_an_int8_cache_weighs_only_the_rows_it_sees(dtype, window):
    """An int8 cache whose rows the query does not see -- other sequences' blocks, slots
    past a sequence's length, rows before its sliding window -- hold the extreme codes
    and NaN scales: the AVX-512 BF16 path converts and scores whole 16-row blocks, so
    a row outside [lo, hi) must weigh exactly nothing, its scales unread or zeroed."""
    k_float, v_float, tables = paged_cache([20, 5], 16, 2, 64, torch.float32, seed=5)
    tables = tables.cpu().long()
    (k_cache, k_scale), (v_cache, v_scale) = (
        quantized_cache(k_float.cpu(), torch.int8),
        quantized_cache(v_float.cpu(), torch.int8),
    )
    clean = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    owned = {int(tables[0, 0]), int(tables[0, 1]), int(tables[1, 0])}
    unseen = [(tables[0, 1], slice(4, None)), (tables[1, 0], slice(5, None))]  # past the lens
    unseen += [(b, slice(None)) for b in range(k_cache.shape[0]) if b not in owned]
    if window is not None:  # sequence 0 sees its last 8 keys: rows 12.. of its first block
        unseen.append((tables[0, 0], slice(None, 12)))
    for block, rows in unseen:
        k_cache[block, rows], v_cache[block, rows] = -128, 127
        k_scale[block, rows], v_scale[block, rows] = float("nan"), float("nan")
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    lens = torch.tensor([20, 5])
    out = cpu.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.125, window, k_scale=k_scale, v_scale=v_scale
    )
    ref = cpu.paged_decode_attention_ref(q, *clean[:2], tables, lens, 0.125, window, *clean[2:])
    assert_close(out, ref, dtype)  # as if the garbage were not there


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_tokens_of_a_chunk_in_one_call_equal_each_token_alone(kv_dtype, block_size, q_dtype):
    """Batch-invariant prefill queries every token of a chunk over the cache: one call of
    many rows (which the int8 path takes several consecutive rows of one table at a time,
    sharing their keys' and values' widening: up to 8 on the AVX-512 BF16 kernels, 16 on
    the AVX2 ones) gives each row the very bits it gets as the only row of a call --
    across the 256-position chunk of the int8 softmax, rows ending in different blocks,
    two sequences' chunks side by side (of 25 rows and of 13), a row of each alone
    between them, NaN scales past the longest row; with the queries of a bfloat16 serve
    and of a float32 one."""
    lens = [300, 150]
    k_float, v_float, tables = paged_cache(lens, block_size, 3, 64, torch.float32, seed=11)
    tables = tables.cpu().long()
    (k_cache, k_scale), (v_cache, v_scale) = (
        quantized_cache(k_float.cpu(), kv_dtype),
        quantized_cache(v_float.cpu(), kv_dtype),
    )
    last = int(tables[0, (lens[0] - 1) // block_size])  # its slots past 300: unread
    if k_scale is not None:
        k_scale[last, lens[0] % block_size :] = v_scale[last, lens[0] % block_size :] = float("nan")
    rows = [(0, n) for n in range(235, 260)] + [(1, 40)] + [(1, n) for n in range(129, 142)]
    rows += [(0, 290), (0, 300)] + [(1, n) for n in range(144, 151)]
    seq = torch.tensor([s for s, _ in rows])
    q = torch.randn(len(rows), 9, 64, generator=torch.Generator().manual_seed(3))
    q = q.to(q_dtype)
    together_tables, together_lens = tables[seq], torch.tensor([n for _, n in rows])
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    together = cpu.paged_decode_attention(
        q, k_cache, v_cache, together_tables, together_lens, 0.125, **scales
    )
    for i in range(len(rows)):
        alone = cpu.paged_decode_attention(
            q[i : i + 1], k_cache, v_cache, together_tables[i : i + 1],
            together_lens[i : i + 1], 0.125, **scales,
        )  # fmt: skip
        assert torch.equal(together[i : i + 1], alone), f"row {i} {rows[i]}"
    assert torch.isfinite(together).all()


def test_paged_decode_attention_rejects_what_it_cannot_run():
    k_cache, v_cache, tables = paged_cache([4], 16, 2, 64, torch.bfloat16, seed=0)
    q = torch.randn(1, 4, 64).to(torch.float16)
    with pytest.raises(ValueError, match="no kernel"):
        cpu.paged_decode_attention(
            q, k_cache.cpu(), v_cache.cpu(), tables.cpu().long(), torch.tensor([4]), 0.1
        )
    with pytest.raises(ValueError, match="int64"):
        cpu.paged_decode_attention(
            q.bfloat16(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), torch.tensor([4]), 0.1
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5003, 4096])  # a partial last 16-lane chunk, and none
def test_greedy_logprobs_match_log_softmax(dtype, vocab):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(33, vocab, generator=g) * 4
    logits[3, [10, 20]] = 50.0  # a tie: the first index wins, as in torch
    logits[4, :100] = float("-inf")  # masked entries are fine
    logits[5] = float("-inf")  # nothing left: NaN, as log_softmax gives
    logits[6, 7] = float("nan")  # NaN is the argmax in torch
    logits[7, vocab - 1] = 60.0  # the maximum in the last lane
    logits[8, 4000] = float("inf")
    logits[9, [3, 11]] = 50.0  # a tie within one of 8 lanes
    logits[10, [9, vocab - 1]] = 50.0  # a tie with the row's last entry (a 5003 row's tail)
    logits = logits.to(dtype)
    ids, logprobs = cpu.greedy_logprobs(logits)
    ref_ids, ref_logprobs = cpu.greedy_logprobs_ref(logits)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5, equal_nan=True)


def _cpu_ops() -> LayerOps:
    """The C++ kernels as an engine on this CPU binds them into the layers."""
    return cpu_ops(cpu.selected_isa() or "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [200, 576])  # 576: bfloat16's 16-lane path
def test_rms_norm_matches_the_torch_layer(dtype, with_residual, hidden):
    from cadence.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x = (torch.randn(37, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(37, hidden, generator=g).to(dtype) if with_residual else None
    bind(norm, _cpu_ops())
    ours = norm(x, residual)
    bind(norm, TORCH_OPS)
    ref = norm(x, residual)
    if with_residual:
        assert_close(ours[0], ref[0], dtype)
        assert torch.equal(ours[1], ref[1])  # x + residual, rounded the same way
    else:
        assert_close(ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [96, 100])  # 96: bfloat16's 16-lane path
def test_silu_mul_matches_the_torch_layer(dtype, inter):
    from cadence.layers.activation import SiluAndMul

    x = (torch.randn(19, 2 * inter, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    layer = SiluAndMul()
    bind(layer, _cpu_ops())
    ours = layer(x)
    bind(layer, TORCH_OPS)
    assert_close(ours, layer(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_a_fused_qkv_view_matches_the_torch_layer(dtype, head_dim):
    from cadence.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 300, 4095])
    qkv = torch.randn(8, (4 + 2 + 2) * head_dim, generator=torch.Generator().manual_seed(5))
    qkv = qkv.to(dtype)
    q_ref = qkv[:, : 4 * head_dim].clone().view(-1, 4, head_dim)
    kv_before = qkv[:, 4 * head_dim :].clone()
    q = qkv[:, : 4 * head_dim].view(-1, 4, head_dim)  # strided rows, as in the model
    bind(rope, _cpu_ops())
    ours = rope.angles(positions, dtype).apply(q)
    assert ours.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(qkv[:, 4 * head_dim :], kv_before)  # the rest of the row untouched
    bind(rope, TORCH_OPS)
    ref = rope.angles(positions, dtype).apply(q_ref)
    assert ref.data_ptr() != q_ref.data_ptr()
    assert_close(ours, ref, dtype)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_rotary_write_kv_matches_the_reference(dtype, kv_dtype, head_dim, heads, kv_heads):
    """Rotated queries into a poisoned buffer, rotated keys and copied values into their
    slots (a strided fused-QKV input with spare columns); every other slot of the caches
    untouched. (bfloat16 with head_dim 64/128 takes the AVX512 path.)"""
    from cadence.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(head_dim + heads)
    tokens = 7
    positions = torch.tensor([0, 1, 15, 16, 17, 300, 4095])
    cos, sin = RotaryEmbedding(head_dim, {"rope_theta": 10000.0, "rope_type": "default"}).cos_sin(
        positions, dtype
    )
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 8, generator=g).to(dtype)[:, :width]
    k_cache = torch.randn(6, 16, kv_heads, head_dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(6, 16, kv_heads, head_dim, generator=g).to(kv_dtype)
    slots = torch.randperm(96, generator=g)[:tokens]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = cpu.rotary_write_kv_ref(qkv, heads, kv_heads, cos, sin, k_ref, v_ref, slots)
    q_out = poisoned((tokens, heads, head_dim), dtype).cpu()
    ours = cpu.rotary_write_kv(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, q_out)
    assert ours.data_ptr() == q_out.data_ptr()
    assert_close(ours, q_ref, dtype)
    flat_k, flat_v = k_cache.view(96, -1), v_cache.view(96, -1)
    assert_close(flat_k[slots], k_ref.view(96, -1)[slots], dtype)
    assert torch.equal(flat_v[slots], v_ref.view(96, -1)[slots])  # a copy (and a cast)
    others = torch.ones(96, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat_k[others], k_ref.view(96, -1)[others])
    assert torch.equal(flat_v[others], v_ref.view(96, -1)[others])


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_write_kv_into_a_quantized_cache_stores_the_torch_definitions_bits(
    kv_dtype, dtype, head_dim
):
    """The kernel's rotated keys and copied values, quantized as it writes them, are the
    bits `cadence.kv_format` gives for what it writes into a cache of the activations'
    dtype (int8 with its scales); every other slot and scale untouched."""
    from cadence.kv_format import quantize

    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, tokens = 9, 3, 7
    angles = torch.rand(tokens, 1, head_dim, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    qkv[0, heads * head_dim] = 1e-6  # an fp8 subnormal in the first key
    slots = torch.randperm(96, generator=g)[:tokens]
    shape = (6, 16, kv_heads, head_dim)
    k_float, v_float = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    cpu.rotary_write_kv(qkv, heads, kv_heads, cos, sin, k_float, v_float, slots)
    k_cache, k_scale = quantized_cache(torch.randn(shape, generator=g), kv_dtype)
    v_cache, v_scale = quantized_cache(torch.randn(shape, generator=g), kv_dtype)
    before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    cpu.rotary_write_kv(
        qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale
    )
    others = torch.ones(96, dtype=torch.bool)
    others[slots] = False
    for new, cache, scale, (old_cache, old_scale) in (
        (k_float, k_cache, k_scale, before[0::2]),
        (v_float, v_cache, v_scale, before[1::2]),
    ):
        rows = cache.view(96, kv_heads, head_dim)
        want, want_scales = quantize(
            new.view(96, kv_heads, head_dim)[slots], _format(kv_dtype), scale
        )
        assert torch.equal(rows[slots].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(
            rows[others].view(torch.uint8),
            old_cache.view(96, kv_heads, head_dim)[others].view(torch.uint8),
        )
        if want_scales is not None:
            assert torch.equal(scale.view(96, kv_heads)[slots], want_scales)
            assert torch.equal(
                scale.view(96, kv_heads)[others], old_scale.view(96, kv_heads)[others]
            )


def _format(dtype: torch.dtype):
    from cadence.kv_format import kv_format

    names = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    return kv_format(names[dtype])

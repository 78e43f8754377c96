"""The quantized KV cache (`--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2`): the formats'
round trips, the cache's bytes and its block moves (scales travel with their blocks),
every attention backend reading it (tightly against float attention over the dequantized
cache, within the format's bound against the float cache it came from), and a model's
logits with it against a float cache."""

from __future__ import annotations

import json

import pytest
import torch
from cadence.attention_backends.base import StepLayout
from cadence.attention_backends.cpu_paged import CpuAttention
from cadence.attention_backends.torch_sdpa import TorchAttention
from cadence.kv_cache import KVCache, bytes_per_block
from cadence.kv_dtypes import check_kv_cache_choice
from cadence.kv_format import dequantize, kv_format, quantize, quantize_fp8, quantize_int8
from cadence.kv_scales import HEADROOM, read_scales_file, write_scales_file
from cadence.layers.attention import Attention
from shard_helpers import MiniRouter, prefill_then_decode_logits

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]
# Largest |attention output - float cache's| over unit-normal keys, values and queries:
# int8 rounds to 1/254 of a row's amax; e4m3 keeps 3 mantissa bits (relative 2^-4), e5m2 2.
OUTPUT_BOUND = {"int8": 0.03, "fp8_e4m3": 0.15, "fp8_e5m2": 0.3}
# The tiny random model's logits with each cache against float32's. Its weights are drawn
# large (sharp distributions, logits spanning about +-10), so fp8's per-element error of
# 6% (e4m3) or 12% (e5m2) moves a logit by up to 1 or 2 and may swap close top tokens;
# int8's keeps the argmax. (On SmolLM2 itself: docs/quantization.md.)
LOGIT_BOUND = {"int8": 0.25, "fp8_e4m3": 2.0, "fp8_e5m2": 4.0}


def _normal(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- the formats ----------------------------------------------------------------------------


def test_int8_round_trip_is_within_half_a_step_of_each_rows_scale() -> None:
    x = _normal(50, 3, 64, seed=0) * torch.linspace(0.01, 100, 50).view(50, 1, 1)
    x[7, 1] = 0.0  # an all-zero row: scale 0, values 0
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3)
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    assert q.abs().max() == 127 and bool((q[7, 1] == 0).all()) and scale[7, 1] == 0
    back = dequantize(q, scale, torch.float32)
    assert bool(((back - x).abs() <= scale.unsqueeze(-1) / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize(("name", "mantissa_bits"), [("fp8_e4m3", 3), ("fp8_e5m2", 2)])
def test_fp8_round_trip_keeps_the_formats_relative_precision_and_saturates(
    name, mantissa_bits
) -> None:
    fmt = kv_format(name)
    scale = torch.tensor([0.05])
    x = _normal(4000, seed=1) * 3
    back = dequantize(quantize_fp8(x, scale, fmt.storage), scale, torch.float32)
    normal = x.abs() / scale > torch.finfo(fmt.storage).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)
    huge = torch.tensor([1e9, -1e9])  # past the range: the largest value, not inf or NaN
    top = dequantize(quantize_fp8(huge, scale, fmt.storage), scale, torch.float32)
    assert torch.equal(top, torch.tensor([fmt.max, -fmt.max]) * 0.05)


def test_kv_format_names() -> None:
    assert kv_format("int8").scales == "token" and kv_format("fp8_e5m2").scales == "layer"
    assert not kv_format("bfloat16").quantized
    with pytest.raises(ValueError, match="not one of"):
        kv_format("int4")


# ---- the cache ------------------------------------------------------------------------------


def test_bytes_per_block_counts_the_scales_and_more_blocks_fit_a_budget() -> None:
    layers, block, heads, dim = 30, 16, 3, 64  # SmolLM2-135M
    bf16 = bytes_per_block(layers, block, heads, dim, kv_format("bfloat16"))
    int8 = bytes_per_block(layers, block, heads, dim, kv_format("int8"))
    fp8 = bytes_per_block(layers, block, heads, dim, kv_format("fp8_e4m3"))
    assert bf16 == layers * 2 * block * heads * dim * 2
    assert int8 == layers * 2 * block * heads * (dim + 4)  # a float32 scale per token-head
    assert fp8 == bf16 // 2  # per-layer scales: nothing per block
    budget = 256 << 20
    assert budget // int8 > 1.8 * (budget // bf16) and budget // fp8 == 2 * (budget // bf16)
    cache = KVCache(layers, 4, block, heads, dim, kv_format("int8"), "cpu")
    held = cache.blocks.nbytes + (
        cache.token_scales.nbytes if cache.token_scales is not None else 0
    )
    assert cache.nbytes == held


def test_the_engine_sizes_more_blocks_under_the_same_byte_budget(model_dirs) -> None:
    from cadence.config import ShardConfig
    from cadence.shard.engine import Engine

    path = str(model_dirs("llama_gqa"))
    blocks = {}
    for kv in ("bfloat16", "int8", "fp8_e4m3"):
        engine = Engine(
            ShardConfig(model_dir=path, uds_path="", dtype="float32", kv_cache_dtype=kv)
        )
        got = engine.warmup(64, 4, kv_cache_bytes=1 << 20)
        assert got.bytes_per_block == engine.bytes_per_block
        blocks[kv] = got.num_blocks
    assert blocks["int8"] == (1 << 20) // (2 * 2 * 16 * 2 * (16 + 4))  # head_dim 16
    assert (
        blocks["int8"] > 1.5 * blocks["bfloat16"] and blocks["fp8_e4m3"] == 2 * blocks["bfloat16"]
    )


@pytest.mark.parametrize("name", QUANTIZED)
def test_copy_on_write_and_swap_round_trip_move_the_scales_with_their_blocks(name) -> None:
    fmt = kv_format(name)
    layer_scales = torch.tensor([[0.5, 0.25], [2.0, 4.0]])
    cache = KVCache(2, 12, 4, 2, 16, fmt, "cpu", layer_scales=layer_scales)
    x = _normal(2, 2, 4, 2, 16, seed=3)  # layers, k/v, block_size, kv_heads, head_dim
    for layer in range(2):
        for kv in range(2):
            stored, row_scales = quantize(x[layer, kv], fmt, cache.scales(layer)[kv])
            cache.blocks[layer, kv, 3] = stored
            if row_scales is not None:
                cache.scales(layer)[kv][3] = row_scales

    def block(i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        held = cache.token_scales
        return cache.blocks[:, :, i].view(torch.uint8).clone(), (
            None if held is None else held[:, :, i].clone()
        )

    def same(a, b) -> bool:
        return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))

    original = block(3)
    assert bool(original[0].any()) and (original[1] is None or bool(original[1].all()))
    cache.copy_blocks([3], [7])
    assert same(block(7), original)
    cache.swap_out([7], [5])
    cache.blocks[:, :, 7].view(torch.uint8).zero_()
    if cache.token_scales is not None:
        cache.token_scales[:, :, 7] = 0
    cache.swap_in([5], [9])
    assert same(block(9), original)
    if fmt.scales == "layer":  # fixed for the cache's life: a moved block reads the same
        assert torch.equal(cache.layer_scales.view(2, 2), layer_scales)


# ---- choosing it ----------------------------------------------------------------------------


def test_scales_file_round_trip_and_what_is_refused(tmp_path) -> None:
    path = tmp_path / "scales.json"
    scales = torch.tensor([[0.5, 0.25], [2.0, 4.0], [1.0, 0.125]])
    write_scales_file(path, scales)
    assert torch.equal(read_scales_file(path, 3), scales)
    with pytest.raises(ValueError, match="holds 3 layers' scales; the model has 2"):
        read_scales_file(path, 2)
    check_kv_cache_choice("fp8_e4m3", str(path))
    with pytest.raises(ValueError, match="--kv-cache-scales is for an fp8 KV cache"):
        check_kv_cache_choice("int8", str(path))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"k_scale": [1.0, -2.0], "v_scale": [1.0, 1.0]}))
    with pytest.raises(ValueError, match="positive"):
        check_kv_cache_choice("fp8_e5m2", str(bad))
    bad.write_text("{")
    with pytest.raises(ValueError, match="expected a JSON file"):
        check_kv_cache_choice("fp8_e5m2", str(bad))
    with pytest.raises(ValueError, match="not one of"):
        check_kv_cache_choice("int4", "")


def test_the_cli_takes_the_quantized_dtypes_and_the_launcher_refuses_a_bad_pair(tmp_path) -> None:
    from cadence.cli import build_parser
    from cadence.config import LaunchConfig
    from cadence.launcher import LaunchError, resolve_cpu_choices

    args = build_parser().parse_args(["launch", "--kv-cache-dtype", "fp8_e4m3"])
    assert args.kv_cache_dtype == "fp8_e4m3" and args.kv_cache_scales == ""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--kv-cache-dtype", "int4"])
    path = tmp_path / "scales.json"
    write_scales_file(path, torch.ones(2, 2))
    cfg = LaunchConfig(kv_cache_dtype="int8", kv_cache_scales=str(path))
    with pytest.raises(LaunchError, match="--kv-cache-scales is for an fp8 KV cache"):
        resolve_cpu_choices(cfg)


# ---- every backend reading it ---------------------------------------------------------------

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 64
DECODE_LENS = [1, 17, 40]
PREFILL = (30, 12)  # context after the step, queries: a chunk over an 18-token prefix


def _layout() -> StepLayout:
    """Three decode rows, then one prefill chunk over a cached prefix, in scattered blocks."""
    lens = [*DECODE_LENS, PREFILL[0]]
    q_lens = [1, 1, 1, PREFILL[1]]
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    tables = torch.zeros(4, 3, dtype=torch.long)
    used = 0
    for row, n in enumerate(lens):
        k = -(-n // BLOCK)
        tables[row, :k] = order[used : used + k]
        used += k
    slots = []
    for row, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
        slots += [int(tables[row, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n - m, n)]
    return StepLayout(
        slot_mapping=torch.tensor(slots),
        query_start=torch.tensor([0, 1, 2, 3, 3 + PREFILL[1]]),
        context_lens=torch.tensor(lens),
        block_tables=tables,
        block_size=BLOCK,
        num_decode=3,
        max_query_len=PREFILL[1],
        decode_blocks=3,
        prefill_blocks=2,
    )


def _layer(k, v, k_scale=None, v_scale=None) -> Attention:
    layer = Attention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = k, v, k_scale, v_scale
    return layer


def _quantized_layer(name: str, k: torch.Tensor, v: torch.Tensor) -> Attention:
    fmt = kv_format(name)
    if fmt.scales == "token":
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    else:  # scales as warm-up would pick them for this cache
        ks = (k.abs().max() * HEADROOM / fmt.max).reshape(1)
        vs = (v.abs().max() * HEADROOM / fmt.max).reshape(1)
        kq, vq = quantize_fp8(k, ks, fmt.storage), quantize_fp8(v, vs, fmt.storage)
    return _layer(kq, vq, ks, vs)


def _attend(backend, layer: Attention, q: torch.Tensor) -> torch.Tensor:
    meta = backend.metadata(_layout())
    out = torch.full_like(q, float("nan"))
    backend.decode(layer, q[:3], meta, out[:3])
    backend.prefill(layer, q[3:], meta, out[3:])
    return out


def _backends() -> list[pytest.param]:
    def triton():
        from cadence.attention_backends.triton_paged import TritonAttention

        return TritonAttention()

    return [
        pytest.param(TorchAttention, id="torch"),
        pytest.param(CpuAttention, id="cpu"),
        pytest.param(triton, id="triton"),
    ]


@pytest.mark.parametrize("make_backend", _backends())
@pytest.mark.parametrize("name", QUANTIZED)
def test_each_backend_reads_a_quantized_cache_as_its_dequantized_floats(make_backend, name):
    backend = make_backend()
    k, v = _normal(16, BLOCK, KV_HEADS, DIM, seed=1), _normal(16, BLOCK, KV_HEADS, DIM, seed=2)
    q = _normal(3 + PREFILL[1], HEADS, DIM, seed=3)
    quantized = _quantized_layer(name, k, v)
    dequantized = _layer(
        dequantize(quantized.k_cache, quantized.k_scale, torch.float32),
        dequantize(quantized.v_cache, quantized.v_scale, torch.float32),
    )
    got = _attend(backend, quantized, q)
    torch.testing.assert_close(got, _attend(backend, dequantized, q), atol=2e-5, rtol=0)
    error = (got - _attend(backend, _layer(k, v), q)).abs().max()
    assert 0 < error < OUTPUT_BOUND[name]


@pytest.mark.parametrize("make_backend", _backends())
@pytest.mark.parametrize("name", QUANTIZED)
def test_each_backend_writes_the_bits_the_torch_definition_stores(make_backend, name):
    """The step's new keys and values through the backend's write: the bits of
    `kv_format.quantize` (and, for int8, of its scales) in their slots."""
    backend = make_backend()
    fmt = kv_format(name)
    cache = KVCache(
        1, 16, BLOCK, KV_HEADS, DIM, fmt, "cpu", layer_scales=torch.tensor([[0.01, 0.003]])
    )
    layer = _layer(*cache.layer(0), *cache.scales(0))
    layout = _layout()
    t = layout.slot_mapping.shape[0]
    k, v = _normal(t, KV_HEADS, DIM, seed=4) * 2, _normal(t, KV_HEADS, DIM, seed=5)
    k[0, 0, :4] = torch.tensor([1e-5, -3e-5, 0.0, 1.2717972])  # fp8 subnormals, a carry
    backend.write_kv(layer, k, v, backend.metadata(layout))
    slots = layout.slot_mapping
    for new, stored_in, scales in (
        (k, layer.k_cache, layer.k_scale),
        (v, layer.v_cache, layer.v_scale),
    ):
        want, want_scales = quantize(new, fmt, scales)
        stored = stored_in.view(-1, KV_HEADS, DIM)[slots]
        assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
        if want_scales is not None:
            assert scales is not None and torch.equal(scales.view(-1, KV_HEADS)[slots], want_scales)


# ---- a model's logits -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "name"),
    # every format on the CPU default (the flat Llama step and its C++ cache writes); the
    # other backends' reads and writes of every format are checked above
    [("cpu", "int8"), ("cpu", "fp8_e4m3"), ("cpu", "fp8_e5m2"), ("torch", "int8"),
     ("triton", "fp8_e4m3")],
)  # fmt: skip
def test_a_models_logits_with_a_quantized_cache_stay_near_a_float_caches(
    backend, name, model_dirs, engine_for
):
    """A prefill of 21 tokens then 9 decodes: float32 weights over a float32 cache and
    over the quantized one (the cpu backend serving through the flat Llama step). Triton's
    float-cache logits equal transformers' as torch's do (test_attention_backends), so its
    reference is the torch backend's: the interpreter runs one engine, not two."""
    path = model_dirs("llama_9_heads_3_kv")
    tokens = torch.randint(3, 256, (31,), generator=torch.Generator().manual_seed(1)).tolist()
    reference_backend = "torch" if backend == "triton" else backend
    ref = prefill_then_decode_logits(
        engine_for(path, attention_backend=reference_backend, kv_cache_dtype="float32"), tokens, 21
    )
    engine = engine_for(path, attention_backend=backend, kv_cache_dtype=name)
    assert engine.kv is not None and engine.kv.blocks.dtype == kv_format(name).storage
    got = prefill_then_decode_logits(engine, tokens, 21)
    error = (got - ref).abs().max()
    assert 0 < error < LOGIT_BOUND[name]
    if name == "int8":
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_fp8_scales_come_from_the_warm_up_forward_or_the_file(model_dirs, engine_for, tmp_path):
    """Without a file: the largest |key| / |value| each layer wrote in a float forward of
    the warm-up prompt, times HEADROOM, over fp8's largest value. With one: the file's."""
    path = model_dirs("llama_gqa")
    engine = engine_for(path, kv_cache_dtype="fp8_e4m3")
    assert engine.kv is not None and engine.kv.layer_scales is not None
    estimated = engine.kv.layer_scales.view(-1, 2)
    # the warm-up prompt: CALIBRATION_TOKENS pseudo-random tokens, at most max_batch_tokens
    # (64 for these engines), seeded with 0
    float_engine = engine_for(path, kv_cache_dtype="float32")
    router = MiniRouter(float_engine)
    prompt = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    router.step(joined=[router.join(0, prompt)])
    assert float_engine.kv is not None
    written = float_engine.kv.blocks[:, :, router.reqs[0].blocks]
    amax = written.abs().amax(dim=(2, 3, 4, 5))
    torch.testing.assert_close(estimated, amax * HEADROOM / 448, rtol=1e-6, atol=0)
    file = tmp_path / "scales.json"
    write_scales_file(file, torch.tensor([[0.5, 0.25], [2.0, 4.0]]))
    engine = engine_for(path, kv_cache_dtype="fp8_e5m2", kv_cache_scales=str(file))
    assert engine.kv is not None and engine.kv.layer_scales is not None
    assert torch.equal(engine.kv.layer_scales.view(-1, 2), torch.tensor([[0.5, 0.25], [2.0, 4.0]]))
    assert torch.equal(engine.attention[1].v_scale, torch.tensor([4.0]))

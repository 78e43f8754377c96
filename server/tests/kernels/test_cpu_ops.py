"""The C++ kernels as torch operators (`torch.ops.cadence.*`, the shim `cpu_ops.cpp`):
`torch.library.opcheck` on every operator with small real inputs for every dtype pairing
its kernel takes (the schema's mutations and aliasing, the fake implementation against the
real one, tracing through AOT dispatch with dynamic shapes); bad arguments rejected before
any pointer reaches the kernel, with the argument named, by the real and the fake
implementation alike; the out= and in-place variants giving the functional ones' bits;
and the operators calling the selected instruction set's library."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from cadence.kernels import cpu
from cadence.kernels.cpu import ops as cpu_ops
from kernel_cases import paged_cache, quantized_cache
from torch._subclasses.fake_tensor import FakeTensorMode

# The operators exist once the kernels are selected, and the cases below name them.
if not cpu.available():
    pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}", allow_module_level=True)

OPS = torch.ops.cadence
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = [F32, BF16, F16]
# (activations, cache): every pairing the attention and cache-write kernels are built for
PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (F32, BF16), (F32, F16), (BF16, F32), (F16, F32)]
# quantized caches (cadence.kv_format), which any activations read, with their scales
I8, E4M3, E5M2 = torch.int8, torch.float8_e4m3fn, torch.float8_e5m2
QUANTIZED_PAIRS = [(F32, I8), (BF16, I8), (F16, E4M3), (BF16, E5M2)]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16
LENS = [1, 17, 5]  # one token, across a block boundary, within one


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _caches(k: torch.Tensor, v: torch.Tensor, kv_dtype: torch.dtype) -> dict[str, Any]:
    """The caches (and scales, for a quantized one) from float ones."""
    (k_cache, k_scale), (v_cache, v_scale) = (
        quantized_cache(k, kv_dtype),
        quantized_cache(v, kv_dtype),
    )
    caches = {"k_cache": k_cache, "v_cache": v_cache}
    if k_scale is not None:
        caches.update(k_scale=k_scale, v_scale=v_scale)
    return caches


def _attention_args(dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, Any]:
    k_cache, v_cache, tables = paged_cache(LENS, BLOCK, KV_HEADS, HEAD_DIM, F32, seed=1)
    q = torch.randn(len(LENS), HEADS, HEAD_DIM, generator=_generator()).to(dtype)
    return {
        "q": q,
        **_caches(k_cache.cpu(), v_cache.cpu(), kv_dtype),
        "block_tables": tables.cpu().long(),
        "context_lens": torch.tensor(LENS),
        "scale": HEAD_DIM**-0.5,
        "sliding_window": None,
    }


def _write_kv_args(dtype: torch.dtype, kv_dtype: torch.dtype, tokens: int) -> dict[str, Any]:
    g = _generator()
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    angles = torch.rand(tokens, 1, HEAD_DIM, generator=g) * 6
    return {
        "qkv": torch.randn(tokens, width, generator=g).to(dtype),
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
        **_caches(
            torch.randn(6, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(6, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
            kv_dtype,
        ),
        "slot_mapping": torch.randperm(6 * BLOCK, generator=g)[:tokens],
    }


def _decode_layer_args(dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, Any]:
    attention = _attention_args(dtype, kv_dtype)
    args = _write_kv_args(dtype, kv_dtype, len(LENS))
    blocks = attention["block_tables"]
    last = torch.tensor(LENS) - 1  # the new token's slot: the last of each sequence
    args.update(
        {k: v for k, v in attention.items() if k.endswith(("_cache", "_scale"))},
        slot_mapping=blocks.gather(1, (last // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK
        + last % BLOCK,
        block_tables=blocks,
        context_lens=attention["context_lens"],
        scale=attention["scale"],
        sliding_window=4,
    )
    return args


def _norm_args(dtype: torch.dtype) -> dict[str, Any]:
    g = _generator()
    return {
        "x": torch.randn(5, 64, generator=g).to(dtype),
        "weight": (torch.rand(64, generator=g) + 0.5).to(dtype),
        "eps": 1e-5,
    }


def _residual(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _lora_args(dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, Any]]:
    """A shrink's and an expand's arguments: 6 rows (two of no adapter) of three adapters
    of ranks 4, 0 and 2 over pools of 40 rows."""
    g = _generator()
    a_idx = torch.randperm(40, generator=g)[:12].view(3, 4)
    adapters = torch.tensor([0, 2, -1, 1, 0, -1])
    shrink = {
        "x": torch.randn(6, 48, generator=g).to(dtype),
        "rows_in": torch.randn(40, 48, generator=g).to(dtype),
        "a_idx": a_idx,
        "ranks": torch.tensor([4, 0, 2]),
        "row_adapter": adapters,
        "rows": None,
        "first_row": 0,
        "h": torch.zeros(6, 4, dtype=dtype),
    }
    expand = {
        "y": torch.randn(6, 40, generator=g).to(dtype),
        "h": torch.randn(6, 4, generator=g).to(dtype),
        "rows_out": torch.randn(40, 24, generator=g).to(dtype),
        "b_idx": a_idx[:, :2],
        "piece_ranks": torch.tensor([2, 0, 1]),
        "rank_start": torch.tensor([2, 0, 1]),
        "out_offset": 8,
        "row_adapter": adapters[1:5],
        "rows": torch.tensor([5, 0, 3, 1]),
        "first_row": 0,
    }
    return shrink, expand


def _cases() -> list[Any]:
    """(operator, its arguments by name) for every operator and dtype pairing."""
    cases: list[tuple[Any, dict[str, Any]]] = []
    q_shape = (len(LENS), HEADS, HEAD_DIM)
    for dtype, kv_dtype in PAIRS + QUANTIZED_PAIRS:
        cases += [
            (OPS.paged_decode_attention.default, _attention_args(dtype, kv_dtype)),
            (
                OPS.paged_decode_attention.out,
                {**_attention_args(dtype, kv_dtype), "out": _empty(*q_shape, dtype=dtype)},
            ),
            (OPS.rotary_write_kv.default, _write_kv_args(dtype, kv_dtype, 3)),
            (
                OPS.rotary_write_kv.out,
                {
                    **_write_kv_args(dtype, kv_dtype, 3),
                    "q_out": _empty(3, HEADS, HEAD_DIM, dtype=dtype),
                },
            ),
            (
                OPS.decode_layer_attention.out,
                {
                    **_decode_layer_args(dtype, kv_dtype),
                    "q_out": _empty(*q_shape, dtype=dtype),
                    "out": _empty(*q_shape, dtype=dtype),
                },
            ),
        ]
    for dtype in DTYPES:
        head = torch.randn(3, HEADS * 2, HEAD_DIM, generator=_generator()).to(dtype)
        angles = torch.rand(3, 1, HEAD_DIM, generator=_generator())
        cases += [
            (OPS.rms_norm.default, _norm_args(dtype)),
            (OPS.rms_norm.out, {**_norm_args(dtype), "out": _empty(5, 64, dtype=dtype)}),
            (OPS.add_rms_norm.default, {"residual": _residual(dtype), **_norm_args(dtype)}),
            (
                OPS.add_rms_norm_.default,
                {
                    "residual": _residual(dtype),
                    **_norm_args(dtype),
                    "out": _empty(5, 64, dtype=dtype),
                },
            ),
            (OPS.silu_mul.default, {"x": _norm_args(dtype)["x"]}),
            (OPS.silu_mul.out, {"x": _norm_args(dtype)["x"], "out": _empty(5, 32, dtype=dtype)}),
            (
                OPS.rotary_.default,  # the query half of each row: a strided view, as in the model
                {
                    "x": head[:, :HEADS],
                    "cos": angles.cos().to(dtype),
                    "sin": angles.sin().to(dtype),
                },
            ),
        ]
    for dtype in (F32, BF16):
        logits = torch.randn(4, 1000, generator=_generator()).to(dtype)
        cases.append((OPS.greedy_logprobs.default, {"logits": logits}))
    for dtype in DTYPES:
        shrink, expand = _lora_args(dtype)
        cases += [
            (OPS.lora_shrink_rows_.default, shrink),
            (OPS.lora_expand_rows_.default, expand),
        ]
    cases += [(OPS.quant_matmul.default, args) for args in _quant_args()]
    if _has_amx_kernel():  # the emulated AMX tiles: what any CPU running these kernels runs
        tiles = [{**args, "tiles": 2} for args in _quant_args()]
        cases += [(OPS.quant_matmul_tiles.default, args) for args in tiles]
        cases += [(OPS.bf16_matmul_tiles.default, args) for args in _bf16_args()]
        cases += [(OPS.bf16_matmul_tiles_swiglu.default, args) for args in _swiglu_args()]
        cases += [(OPS.decode_layers.default, args) for args in _decode_layers_args(True)]
    cases += [(OPS.float_matmul.default, args) for args in _float_args()]
    cases += [(OPS.decode_layers.default, args) for args in _decode_layers_args(False)]
    return [pytest.param(op, args, id=f"{op}-{_dtypes(args)}") for op, args in cases]


def _quant_args() -> list[dict[str, Any]]:
    """quant_matmul over each packed format, float32 and bfloat16 inputs (the packings are
    cadence.quant.cpu_gemm's)."""
    from cadence.quant import cpu_gemm
    from cadence.quant.quantize import quantize_int4, quantize_int8, quantize_int8_blocks

    w = torch.randn(40, 64, generator=_generator())
    packed = [
        cpu_gemm.pack_int4(quantize_int4(w, 32)),
        cpu_gemm.pack_int8(quantize_int8(w)),
        cpu_gemm.pack_int8_blocks(quantize_int8_blocks(w)),
    ]
    x = torch.randn(3, 64, generator=_generator())
    return [
        {
            "x": x.to(dtype),
            "packed": p.packed,
            "scales": p.scales,
            "out_features": 40,
            "format": p.fmt,
        }
        for p in packed
        for dtype in (F32, BF16)
    ]


def _float_args() -> list[dict[str, Any]]:
    """float_matmul with and without a bias, on rows packed and strided (the packing is
    cadence.layers.packed's)."""
    from cadence.layers.packed import tile_packing

    w = torch.randn(40, 64, generator=_generator())
    x = torch.randn(3, 128, generator=_generator())
    bias = torch.randn(40, generator=_generator())
    packed = tile_packing(w)
    return [
        {"x": x[:, :64], "packed": packed, "bias": None, "out_features": 40},
        {"x": x[:, ::2], "packed": packed, "bias": bias, "out_features": 40},
    ]


def _bf16_args() -> list[dict[str, Any]]:
    """bf16_matmul_tiles on the emulated tiles, with and without a bias, on rows packed and
    strided, the input width not a multiple of 32 (the packing is cadence.layers.packed's)."""
    from cadence.layers.packed import amx_bf16_packing

    w = torch.randn(40, 72, generator=_generator()).to(BF16)
    x = torch.randn(3, 144, generator=_generator()).to(BF16)
    bias = torch.randn(40, generator=_generator()).to(BF16)
    packed = amx_bf16_packing(w)
    return [
        {"x": x[:, :72], "packed": packed, "bias": None, "out_features": 40, "tiles": 2},
        {"x": x[:, ::2], "packed": packed, "bias": bias, "out_features": 40, "tiles": 2},
    ]


def _swiglu_args() -> list[dict[str, Any]]:
    """bf16_matmul_tiles_swiglu on the emulated tiles, on rows packed and strided, the input
    width not a multiple of 32."""
    from cadence.layers.packed import amx_bf16_packing

    packed = amx_bf16_packing(torch.randn(64, 72, generator=_generator()).to(BF16))
    x = torch.randn(3, 144, generator=_generator()).to(BF16)
    return [
        {"x": x[:, :72], "packed": packed, "inter": 32, "tiles": 2},
        {"x": x[:, ::2], "packed": packed, "inter": 32, "tiles": 2},
    ]


def _decode_layers_args(amx: bool) -> list[dict[str, Any]]:
    """decode_layers over two layers of hidden 64 (HEADS query heads over KV_HEADS of
    HEAD_DIM, SwiGLU of 32), the second with a sliding window: on the emulated AMX-BF16
    tiles over a bfloat16 and an int8 cache (`amx`), or on the integer product (int4,
    float32 activations and cache), the first layer's or a later one's call."""
    from cadence.layers.packed import amx_bf16_packing
    from cadence.quant import cpu_gemm
    from cadence.quant.quantize import quantize_int4

    g = _generator()
    hidden, width, inter = 64, (HEADS + 2 * KV_HEADS) * HEAD_DIM, 32
    shapes = [(width, hidden), (hidden, HEADS * HEAD_DIM), (2 * inter, hidden), (hidden, inter)]
    dtype = BF16 if amx else F32
    cases = []
    for kv_dtype in (BF16, I8) if amx else (F32,):
        for later in (False, True):
            args = _decode_layer_args(dtype, kv_dtype)
            weights, specs, caches, scales = [], [], [], []
            for _ in range(2):
                weights += [(torch.rand(hidden, generator=g) + 0.5).to(dtype) for _ in "io"]
                for shape in shapes:
                    w = torch.randn(*shape, generator=g) * 0.1
                    if amx:
                        packed = amx_bf16_packing(w.to(BF16))
                        weights += [packed, packed]
                        specs += [0, shape[0], 0, 2]
                    else:
                        q = cpu_gemm.pack_int4(quantize_int4(w, 32))
                        weights += [q.packed, q.scales]
                        specs += [1, shape[0], q.fmt, 0]
                caches += [args["k_cache"].clone(), args["v_cache"].clone()]
                if "k_scale" in args:
                    scales += [args["k_scale"].clone(), args["v_scale"].clone()]
            rows = len(LENS)
            cases.append(
                {
                    "residual": torch.randn(rows, hidden, generator=g).to(dtype),
                    "x": torch.randn(rows, hidden, generator=g).to(dtype) if later else None,
                    "weights": weights,
                    "specs": specs,
                    "caches": caches,
                    "scales": scales,
                    "windows": [0, 4],
                    **{k: args[k] for k in ("cos", "sin", "slot_mapping", "block_tables")},
                    "context_lens": args["context_lens"],
                    "heads": HEADS,
                    "kv_heads": KV_HEADS,
                    "scale": HEAD_DIM**-0.5,
                    "eps": 1e-5,
                }
            )
    return cases


def _has_amx_kernel() -> bool:
    """Whether the selected kernels have quant_matmul_tiles' AMX product (avx512_bf16's)."""
    return cpu.selected_isa() == "avx512_bf16"


def _dtypes(args: dict[str, Any]) -> str:
    seen = dict.fromkeys(str(v.dtype)[6:] for v in args.values() if isinstance(v, torch.Tensor))
    return "-".join(d for d in seen if d != "int64")


def _in_order(op: Any, args: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments in the schema's order (the outputs too: none is keyword-only)."""
    return tuple(args[a.name] for a in op._schema.arguments if a.name in args)


def _name(op: Any) -> str:
    return f"{op._schema.name.removeprefix('cadence::')}.{op._overloadname}"


@pytest.mark.parametrize(("op", "args"), _cases())
def test_opcheck(op, args):
    fp8 = any(getattr(v, "dtype", None) in (E4M3, E5M2) for v in args.values())
    # test_schema compares the tensors around the call with arithmetic torch lacks for
    # float8 ("mul_cpu_reduced_float"); the int8 cases cover the same schemas with it
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if fp8 else None
    torch.library.opcheck(op, _in_order(op, args), **({"test_utils": utils} if utils else {}))


def test_every_operator_has_an_opcheck_case():
    schemas = [s for s in torch._C._jit_get_all_schemas() if s.name.startswith("cadence::")]
    defined = {
        f"{s.name.removeprefix('cadence::')}.{s.overload_name or 'default'}"
        for s in schemas
        if not s.name.startswith("cadence::_")  # the shim's own: which library it calls
        and any("Tensor" in str(a.type) for a in s.arguments)  # amx_available: nothing to check
    }
    if not _has_amx_kernel():  # their cases need the AMX kernels (test_quant_amx_kernel)
        defined.discard("quant_matmul_tiles.default")
        defined.discard("bf16_matmul_tiles.default")
        defined.discard("bf16_matmul_tiles_swiglu.default")
    assert {_name(case.values[0]) for case in _cases()} == defined


def _bad_cases() -> list[Any]:
    """(operator, good arguments with one changed, the error naming what is wrong)."""
    q_shape = (len(LENS), HEADS, HEAD_DIM)
    attention = {**_attention_args(BF16, BF16), "out": _empty(*q_shape, dtype=BF16)}
    k_cache, v_cache = attention["k_cache"], attention["v_cache"]
    write_kv = {**_write_kv_args(F32, BF16, 3), "q_out": _empty(3, HEADS, HEAD_DIM, dtype=F32)}
    decode_layer = {
        **_decode_layer_args(BF16, BF16),
        "q_out": _empty(*q_shape, dtype=BF16),
        "out": _empty(*q_shape, dtype=BF16),
    }
    norm = {**_norm_args(BF16), "out": _empty(5, 64, dtype=BF16)}
    head = torch.randn(3, 2 * HEADS, HEAD_DIM).to(BF16)
    rotary = {"x": head[:, :HEADS], "cos": _empty(3, 1, HEAD_DIM, dtype=BF16)}
    rotary["sin"] = rotary["cos"]
    strided = k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # k_cache's shape, not packed
    int8_attention = {**_attention_args(BF16, I8), "out": None}
    fp8_write = {
        **_write_kv_args(F32, E4M3, 3),
        "q_out": _empty(3, HEADS, HEAD_DIM, dtype=F32),
    }
    cases = [
        (OPS.paged_decode_attention.out, {"q": attention["q"].double()}, "q must be float32"),
        (
            OPS.paged_decode_attention.out,
            {"q": attention["q"][:, :3]},
            "q must be .* multiple of 2",
        ),
        (OPS.paged_decode_attention.out, {"k_cache": strided}, "k_cache must be a contiguous"),
        (OPS.paged_decode_attention.out, {"k_cache": k_cache.to("meta")}, "k_cache must be a CPU"),
        (OPS.paged_decode_attention.out, {"v_cache": v_cache[:-1]}, "v_cache must be contiguous"),
        (
            OPS.paged_decode_attention.out,
            {"q": attention["q"].half()},
            "no kernel for torch.float16",
        ),
        (
            OPS.paged_decode_attention.out,
            {"block_tables": attention["block_tables"].int()},
            "block_tables must be int64",
        ),
        (
            OPS.paged_decode_attention.out,
            {"context_lens": attention["context_lens"][:2]},
            r"context_lens must be int64 \[3\]",
        ),
        (OPS.paged_decode_attention.out, {"out": _empty(*q_shape, dtype=F32)}, "out must be"),
        (
            OPS.paged_decode_attention.default,
            {"v_cache": v_cache.transpose(2, 3).contiguous().transpose(2, 3)},
            "v_cache must be contiguous, shaped",
        ),
        (
            OPS.rms_norm.out,
            {"weight": norm["weight"].float()},
            r"weight must be torch.bfloat16 \[64\]",
        ),
        (OPS.rms_norm.out, {"out": _empty(64, 5, dtype=BF16).t()}, "out must be a contiguous"),
        (OPS.add_rms_norm.default, {"residual": _residual(BF16)[:4]}, "residual must be"),
        (
            OPS.add_rms_norm_.default,
            {"residual": _empty(64, 5, dtype=BF16).t()},
            "residual must be a contiguous",
        ),
        (OPS.silu_mul.out, {"x": norm["x"][:, :63]}, r"x must be .* \[rows, 2 \* inter\]"),
        (OPS.silu_mul.out, {"out": _empty(5, 31, dtype=BF16)}, r"out must be .*\[5, 32\]"),
        (OPS.rotary_.default, {"x": head[:, :, ::2]}, "x must be .* heads packed"),
        (OPS.rotary_.default, {"cos": rotary["cos"].float()}, "cos must be torch.bfloat16"),
        (OPS.rotary_write_kv.out, {"qkv": write_kv["qkv"][:, :-1]}, "qkv must be"),
        (OPS.rotary_write_kv.out, {"slot_mapping": write_kv["slot_mapping"].int()}, "slot_mapping"),
        (OPS.rotary_write_kv.out, {"kv_heads": 3}, "kv_heads must be the cache's 2, got 3"),
        (OPS.rotary_write_kv.out, {"sin": write_kv["sin"][:2]}, "sin must be shaped and typed"),
        (OPS.rotary_write_kv.out, {"q_out": _empty(3, HEADS, HEAD_DIM, dtype=BF16)}, "q_out must"),
        (
            OPS.decode_layer_attention.out,
            {"block_tables": decode_layer["block_tables"][:2]},
            r"block_tables must be int64 \[3, blocks\]",
        ),
        (OPS.decode_layer_attention.out, {"out": _empty(3, HEADS, 32, dtype=BF16)}, "out must be"),
        (OPS.greedy_logprobs.default, {"logits": torch.randn(2, 10).half()}, "logits must be"),
        (
            OPS.paged_decode_attention.out,
            {"k_scale": torch.ones(1), "v_scale": torch.ones(1)},
            "k_scale and v_scale are for an int8 or fp8 cache, not a torch.bfloat16 one",
        ),
        (
            OPS.paged_decode_attention.default,
            {**int8_attention, "v_scale": None},
            "v_scale must be given with a torch.int8 cache",
        ),
        (
            OPS.paged_decode_attention.default,
            {**int8_attention, "k_scale": int8_attention["k_scale"][:, :8]},
            r"k_scale must be a contiguous torch.float32 \[\d+, 16, 2\]",
        ),
        (
            OPS.rotary_write_kv.out,
            {**fp8_write, "k_scale": torch.ones(2)},
            "k_scale must be a torch.float32 tensor of one element",
        ),
    ]
    from cadence.layers.packed import tile_packing

    floats = {"x": torch.randn(3, 64), "packed": tile_packing(torch.randn(40, 64))}
    floats |= {"bias": None, "out_features": 40}
    cases += [
        (OPS.float_matmul.default, {"x": floats["x"].double()}, r"x must be float32 \[rows, in\]"),
        (
            OPS.float_matmul.default,
            {"x": torch.randn(3, 63)},
            r"x must be \[rows, 64\] \(the packed weight's input columns\)",
        ),
        (
            OPS.float_matmul.default,
            {"packed": floats["packed"].transpose(0, 1)},
            r"packed must be a contiguous float32 \[n16, in, 16\]",
        ),
        (OPS.float_matmul.default, {"out_features": 50}, "out_features 50 does not fill"),
        (OPS.float_matmul.default, {"bias": torch.randn(41)}, r"bias must be float32 \[40\]"),
    ]
    bases = {
        "float_matmul.default": floats,
        "paged_decode_attention.out": attention,
        "paged_decode_attention.default": {k: v for k, v in attention.items() if k != "out"},
        "rms_norm.out": norm,
        "add_rms_norm.default": {"residual": _residual(BF16), **_norm_args(BF16)},
        "add_rms_norm_.default": {"residual": _residual(BF16), **norm},
        "silu_mul.out": {"x": norm["x"], "out": _empty(5, 32, dtype=BF16)},
        "rotary_.default": rotary,
        "rotary_write_kv.out": write_kv,
        "decode_layer_attention.out": decode_layer,
        "greedy_logprobs.default": {},
    }
    return [
        pytest.param(
            op,
            {**bases[_name(op)], **change},
            f"cadence::{_name(op)}: ".replace(".default", "") + why,
            id=f"{_name(op)}-{re.sub(r'[^A-Za-z0-9_ ]', '', why)}",
        )
        for op, change, why in cases
    ]


@pytest.mark.parametrize(("op", "args", "error"), _bad_cases())
def test_bad_arguments_are_rejected_naming_the_argument(op, args, error):
    with pytest.raises(ValueError, match=error):
        op(*_in_order(op, args))


@pytest.mark.parametrize(("op", "args", "error"), _bad_cases())
def test_the_fake_implementation_rejects_them_too(op, args, error):
    with FakeTensorMode() as mode:
        fake = {
            k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()
        }
        with pytest.raises(ValueError, match=error):
            op(*_in_order(op, fake))


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place_gives_the_functional_bits(dtype):
    args = _norm_args(dtype)
    residual = _residual(dtype)
    expected, expected_residual = OPS.add_rms_norm(residual, args["x"], args["weight"], 1e-5)
    out = _empty(5, 64, dtype=dtype)
    OPS.add_rms_norm_(residual, args["x"], args["weight"], 1e-5, out=out)
    assert torch.equal(out, expected)
    assert torch.equal(residual, expected_residual)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize(("dtype", "kv_dtype"), PAIRS + QUANTIZED_PAIRS)
def test_decode_layer_attention_is_the_cache_write_then_the_attention(dtype, kv_dtype):
    args = _decode_layer_args(dtype, kv_dtype)
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    k_scale, v_scale = (args[n].clone() if n in args else None for n in ("k_scale", "v_scale"))
    q = OPS.rotary_write_kv(
        args["qkv"], HEADS, KV_HEADS, args["cos"], args["sin"], k_cache, v_cache,
        args["slot_mapping"], k_scale, v_scale,
    )  # fmt: skip
    expected = OPS.paged_decode_attention(
        q, k_cache, v_cache, args["block_tables"], args["context_lens"], args["scale"], 4,
        k_scale, v_scale,
    )  # fmt: skip
    q_out = _empty(len(LENS), HEADS, HEAD_DIM, dtype=dtype)
    out = _empty(len(LENS), HEADS, HEAD_DIM, dtype=dtype)
    op = OPS.decode_layer_attention.out
    op(*_in_order(op, {**args, "q_out": q_out, "out": out}))
    assert torch.equal(q_out, q)
    assert torch.equal(out, expected)
    for name, mine in (("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale)):
        if mine is not None:
            assert torch.equal(args[name].view(torch.uint8), mine.view(torch.uint8))


def test_the_operators_call_the_selected_instruction_sets_library(cpu_isa):
    assert Path(cpu_ops.in_use()).samefile(cpu.library(cpu_isa))

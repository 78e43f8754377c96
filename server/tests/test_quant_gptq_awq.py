"""GPTQ and AWQ folders read as quantized sources: every linear equals, exactly, the
dequantization the test's own quantizer and packers stand for; the float tensors pass
through; what cadence cannot serve is refused naming the config field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cadence.quant.awq import AWQSource
from cadence.quant.checkpoints import open_quantized_checkpoint
from cadence.quant.formats import Int4Weight, Int8Weight
from cadence.quant.gptq import GPTQSource
from quantized_checkpoints import (
    LINEARS,
    Quantized,
    awq_config,
    awq_tensors,
    gptq_config,
    gptq_tensors,
    write_quantized,
)
from safetensors.torch import load_file, save_file

ModelDirs = Callable[[str], Path]


def _float_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _check_source(
    source: Any, expected: dict[str, torch.Tensor], float_dir: Path
) -> dict[str, Int4Weight | Int8Weight]:
    """The source's linears dequantize to `expected` exactly; its float tensors are the
    float checkpoint's other tensors, unchanged."""
    linears = dict(source.quantized_linears())
    assert sorted(linears) == sorted(expected)
    for name, weight in linears.items():
        assert torch.equal(weight.dequantize(), expected[name]), name
    floats = dict(source.float_tensors())
    state = _float_state(float_dir)
    assert sorted(floats) == sorted(n for n in state if n not in expected)
    for name, tensor in floats.items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    return linears


def _groups(group_size: int) -> str:
    return "per-channel" if group_size == -1 else f"g{group_size}"


GPTQ_CASES = [
    # checkpoint_format, sym, group_size, act-order (a shuffled g_idx)
    ("gptq", True, 32, False),
    ("gptq", False, 64, False),
    ("gptq", False, -1, False),
    ("gptq_v2", True, 64, False),
    ("gptq_v2", False, 32, False),
    ("gptq", False, 32, True),
    ("gptq_v2", True, 64, True),
]


@pytest.mark.parametrize(("fmt", "sym", "group_size", "act_order"), GPTQ_CASES)
def test_gptq_linears_equal_the_checkpoints_dequantization(
    model_dirs: ModelDirs, tmp_path: Path, fmt: str, sym: bool, group_size: int, act_order: bool
) -> None:
    float_dir = model_dirs("llama_gqa")
    qc = gptq_config(checkpoint_format=fmt, sym=sym, group_size=group_size, desc_act=act_order)
    expected = write_quantized(
        float_dir, tmp_path / "q", qc, act_order_seed=1 if act_order else None
    )
    assert len(expected) == 2 * len(LINEARS)
    source = open_quantized_checkpoint(tmp_path / "q")
    assert isinstance(source, GPTQSource)
    assert source.description.startswith(f"gptq int4 {_groups(group_size)}")
    linears = _check_source(source, expected, float_dir)
    for weight in linears.values():
        assert isinstance(weight, Int4Weight)
        size = weight.shape[1] if group_size == -1 else group_size
        assert weight.group_size == size
        # a shuffled g_idx with more than one group needs a column order
        assert (weight.perm is not None) == (act_order and weight.shape[1] > size)


def test_act_order_weight_multiplies_through_its_perm(
    model_dirs: ModelDirs, tmp_path: Path
) -> None:
    """Int4Weight's contract for act-order: x @ dequantize().T == x[:, perm] @ w_perm.T,
    where w_perm is the weight in q's own (group-contiguous) column order."""
    qc = gptq_config(group_size=32, desc_act=True, sym=False)
    write_quantized(model_dirs("llama_gqa"), tmp_path / "q", qc, act_order_seed=3)
    name, weight = next(iter(GPTQSource(tmp_path / "q", qc).quantized_linears()))
    assert isinstance(weight, Int4Weight) and weight.perm is not None
    groups = (weight.q.to(torch.float64) - 8).reshape(weight.shape[0], -1, 32)
    in_perm_order = groups * weight.scale.double().unsqueeze(-1) + weight.zero.double().unsqueeze(
        -1
    )
    x = torch.randn(3, weight.shape[1], dtype=torch.float64)
    reference = x @ weight.dequantize(torch.float64).T
    torch.testing.assert_close(x[:, weight.perm] @ in_perm_order.reshape(weight.shape).T, reference)


def test_gptq_v1_reads_a_stored_zero_of_15_as_16(tmp_path: Path) -> None:
    """v1 stores z - 1 and readers add 1 without wrapping; random integers cover every
    nibble value in every position of a word, so a misplaced bit changes the result."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features, group_size = 16, 64, 32
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    stored = torch.randint(0, 16, (out_features, in_features // group_size), generator=generator)
    stored[0, 0] = 15
    scales = (torch.rand(out_features, 2, generator=generator) + 0.01).to(torch.float16)
    g_idx = torch.arange(in_features) // group_size
    for fmt, offset in (("gptq", 1), ("gptq_v2", 0)):
        quant = Quantized(q, stored + offset, scales, g_idx)
        folder = tmp_path / fmt
        folder.mkdir()
        parts = gptq_tensors(quant, 4, v1=fmt == "gptq")
        save_file({f"layer.{k}": v for k, v in parts.items()}, str(folder / "model.safetensors"))
        qc = gptq_config(checkpoint_format=fmt, sym=False)
        (_, weight), *_ = GPTQSource(folder, qc).quantized_linears()
        assert torch.equal(weight.dequantize(), quant.dequantize()), fmt
        zero = 16 if fmt == "gptq" else 15
        expected = (q[0, :group_size].float() - zero) * scales[0, 0].float()
        assert torch.equal(weight.dequantize()[0, :group_size], expected), fmt


def test_gptq_sharded_with_bias_lm_head_and_dynamic_rules(
    model_dirs: ModelDirs, tmp_path: Path
) -> None:
    """Parts of one linear in different shards; biases pass through as float; lm_head
    quantized; a `dynamic` rule leaves down_proj in float, another gives layer 1's
    linears groups of 64."""
    float_dir = model_dirs("llama_bias")
    dynamic = {r"-:.*\.mlp\.down_proj": {}, r"+:model\.layers\.1\.": {"group_size": 64}}
    qc = gptq_config(group_size=32, lm_head=True, dynamic=dynamic, sym=False)
    expected = write_quantized(
        float_dir,
        tmp_path / "q",
        qc,
        quantize_lm_head=True,
        keep_float=("down_proj",),
        group_size_of={"model.layers.1.": 64},
        shards=3,
    )
    assert "lm_head.weight" in expected
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "model.layers.0.self_attn.q_proj"
    assert len({index[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales")}) > 1
    source = GPTQSource(tmp_path / "q", qc)
    linears = _check_source(source, expected, float_dir)
    floats = dict(source.float_tensors())
    assert f"{prefix}.bias" in floats and "model.layers.0.mlp.down_proj.weight" in floats
    assert linears["model.layers.1.mlp.up_proj.weight"].group_size == 64
    assert linears["model.layers.0.mlp.up_proj.weight"].group_size == 32


def test_gptq_8bit_symmetric_per_channel_is_int8(model_dirs: ModelDirs, tmp_path: Path) -> None:
    float_dir = model_dirs("llama_gqa")
    qc = gptq_config(bits=8, group_size=-1, sym=True, checkpoint_format="gptq")
    expected = write_quantized(float_dir, tmp_path / "q", qc)
    linears = _check_source(GPTQSource(tmp_path / "q", qc), expected, float_dir)
    assert all(isinstance(w, Int8Weight) for w in linears.values())


@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_awq_linears_equal_the_checkpoints_dequantization(
    model_dirs: ModelDirs, tmp_path: Path, group_size: int
) -> None:
    float_dir = model_dirs("llama_bias")
    qc = awq_config(group_size=group_size)
    expected = write_quantized(float_dir, tmp_path / "q", qc, shards=2 if group_size == 64 else 1)
    source = open_quantized_checkpoint(tmp_path / "q")
    assert isinstance(source, AWQSource) and source.description == f"awq int4 {_groups(group_size)}"
    linears = _check_source(source, expected, float_dir)
    assert all(isinstance(w, Int4Weight) and w.perm is None for w in linears.values())


def test_awq_nibble_order_is_interleaved(tmp_path: Path) -> None:
    """One word holding 0..7 in AWQ's layout reads back as output columns 0..7: nibble k
    holds column (0, 2, 4, 6, 1, 3, 5, 7)[k], so the word is 0x75316420."""
    q = torch.arange(8).reshape(1, 8).repeat(32, 1).t()  # [out 8, in 32]: row o holds o
    quant = Quantized(
        q,
        torch.zeros(8, 1, dtype=torch.int64),
        torch.ones(8, 1, dtype=torch.float16),
        torch.zeros(32, dtype=torch.int64),
    )
    parts = awq_tensors(quant)
    assert int(np.uint32(parts["qweight"][0, 0].item())) == 0x75316420
    save_file({f"layer.{k}": v for k, v in parts.items()}, str(tmp_path / "model.safetensors"))
    (_, weight), *_ = AWQSource(tmp_path, awq_config(group_size=-1)).quantized_linears()
    assert torch.equal(weight.dequantize(), q.float())


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (gptq_config(bits=3), "bits"),
        (gptq_config(bits=2), "bits"),
        (gptq_config(bits=8, group_size=128), "group_size"),
        (gptq_config(bits=8, group_size=-1, sym=False), "sym"),
        (gptq_config(checkpoint_format="marlin"), "checkpoint_format"),
        ({**gptq_config(checkpoint_format=None), "format": "bitblas"}, "format 'bitblas'"),
        (gptq_config(is_marlin_format=True), "is_marlin_format"),
        (gptq_config(pack_dtype="int16"), "pack_dtype"),
        (gptq_config(dynamic={"+:.*mlp": {"bits": 3}}), "bits"),
        (awq_config(version="gemv"), "version"),
        (awq_config(version="marlin"), "version"),
        (awq_config(bits=8), "bits"),
        (awq_config(zero_point=False), "zero_point"),
        (awq_config(backend="llm-awq"), "backend"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
    ],
)
def test_unsupported_quantization_is_refused_naming_the_field(
    model_dirs: ModelDirs, tmp_path: Path, config: dict[str, Any], field: str
) -> None:
    folder = tmp_path / "q"
    folder.mkdir()
    model_config = json.loads((model_dirs("llama_gqa") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**model_config, "quantization_config": config}))
    with pytest.raises(ValueError, match=field):
        open_quantized_checkpoint(folder)


def test_a_packed_linear_that_dynamic_excludes_is_refused(
    model_dirs: ModelDirs, tmp_path: Path
) -> None:
    qc = gptq_config(dynamic={r"-:.*\.mlp\.": {}})
    write_quantized(model_dirs("llama_gqa"), tmp_path / "q", qc)
    with pytest.raises(ValueError, match="dynamic"):
        list(GPTQSource(tmp_path / "q", qc).quantized_linears())

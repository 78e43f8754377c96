"""Writes small GPTQ and AWQ checkpoints from a float model folder, for the tests.

The quantizer (min/max per group) and the packers are the tests' own, written from the
published formats and independent of cadence's readers: GPTQ packs 32 / bits values per
int32 along the input dimension of qweight [in / per, out] and along the output
dimension of qzeros [groups, out / per], first value in the lowest bits, and its v1
format stores each zero point minus one; AWQ's GEMM layout stores qweight [in, out / 8]
and qzeros [groups, out / 8] with nibble k of each word holding output column
8 * word + (0, 2, 4, 6, 1, 3, 5, 7)[k]. Every writer returns the dequantized float weights
the checkpoint stands for, `(q - z) * s` in float32, computed from its own integers.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    """One linear: integers q [out, in], zero points z and fp16 scales s [out, groups],
    the group of every input column."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        z = self.z[:, self.g_idx].to(torch.float32)
        return (self.q.to(torch.float32) - z) * self.s[:, self.g_idx].to(torch.float32)


def quantize(
    w: torch.Tensor, group_size: int, sym: bool, g_idx: torch.Tensor | None = None, bits: int = 4
) -> Quantized:
    """Min/max quantization of w [out, in] per (row, group); `g_idx` defaults to
    contiguous groups; the zero point of an asymmetric group is kept in 1..max so that
    GPTQ v1's stored `z - 1` is never negative."""
    out_features, in_features = w.shape
    size = in_features if group_size == -1 else group_size
    if g_idx is None:
        g_idx = torch.arange(in_features) // size
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    q = torch.empty(out_features, in_features, dtype=torch.int64)
    z = torch.empty(out_features, groups, dtype=torch.int64)
    s = torch.empty(out_features, groups, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        block = w[:, cols].double()
        if sym:
            scale = (block.abs().amax(1) * 2 / top).clamp_min(1e-4)
            zero = torch.full((out_features,), (top + 1) // 2, dtype=torch.int64)
        else:
            low, high = block.amin(1).clamp_max(0), block.amax(1).clamp_min(0)
            scale = ((high - low) / top).clamp_min(1e-4)
            zero = torch.round(-low / scale).to(torch.int64).clamp(1, top)
        scale16 = scale.to(torch.float16)
        s[:, g] = scale16
        z[:, g] = zero
        ints = torch.round(block / scale16.double().unsqueeze(1)) + zero.unsqueeze(1)
        q[:, cols] = ints.clamp(0, top).to(torch.int64)
    return Quantized(q, z, s, g_idx)


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """values [rows, n * per] -> int32 [rows, n]: value n * per + k at bit k * bits."""
    per = 32 // bits
    rows, cols = values.shape
    words = np.zeros((rows, cols // per), dtype=np.uint64)
    for k in range(per):
        words |= values[:, k::per].astype(np.uint64) << np.uint64(k * bits)
    return words.astype(np.uint32).view(np.int32)


def gptq_tensors(quant: Quantized, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    stored_zeros = quant.z.numpy().T - (1 if v1 else 0)  # [groups, out]
    return {
        "qweight": torch.from_numpy(_words(quant.q.numpy(), bits).T.copy()),  # along input
        "qzeros": torch.from_numpy(_words(stored_zeros, bits)),
        "scales": quant.s.t().contiguous(),
        "g_idx": quant.g_idx.to(torch.int32),
    }


def awq_tensors(quant: Quantized) -> dict[str, torch.Tensor]:
    def pack(values: np.ndarray) -> torch.Tensor:  # [rows, out] in column order
        rows, cols = values.shape
        words = np.zeros((rows, cols // 8), dtype=np.uint64)
        for k, column in enumerate(AWQ_NIBBLE_COLUMNS):
            words |= values[:, column::8].astype(np.uint64) << np.uint64(4 * k)
        return torch.from_numpy(words.astype(np.uint32).view(np.int32))

    return {
        "qweight": pack(quant.q.numpy().T),
        "qzeros": pack(quant.z.numpy().T),
        "scales": quant.s.t().contiguous(),
    }


def _is_quantized_linear(name: str, with_lm_head: bool) -> bool:
    if name == "lm_head.weight":
        return with_lm_head
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def write_quantized(
    float_dir: Path,
    out: Path,
    quantization_config: dict[str, Any],
    *,
    act_order_seed: int | None = None,
    quantize_lm_head: bool = False,
    keep_float: tuple[str, ...] = (),
    group_size_of: dict[str, int] | None = None,
    shards: int = 1,
) -> dict[str, torch.Tensor]:
    """A GPTQ or AWQ folder at `out` from the float checkpoint in `float_dir`. Returns the
    float32 weight every quantized linear stands for, by Hugging Face weight name.

    `act_order_seed`: shuffle each linear's g_idx (GPTQ desc_act); `keep_float`: module
    name fragments left unquantized; `group_size_of`: per-module-fragment group sizes (a
    GPTQModel `dynamic` override); `shards` > 1 writes an index and splits every linear's
    parts across files."""
    qc = quantization_config
    method, bits = qc["quant_method"], qc.get("bits", 4)
    state = load_file(str(float_dir / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(act_order_seed or 0)
    for name, tensor in state.items():
        if not _is_quantized_linear(name, quantize_lm_head) or any(k in name for k in keep_float):
            tensors[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        group_size = next(
            (g for k, g in (group_size_of or {}).items() if k in prefix), qc["group_size"]
        )
        in_features = tensor.shape[1]
        g_idx = None
        if act_order_seed is not None:
            size = in_features if group_size == -1 else group_size
            contiguous = torch.arange(in_features) // size
            g_idx = contiguous[torch.randperm(in_features, generator=generator)]
        quant = quantize(tensor, group_size, qc.get("sym", False), g_idx, bits)
        if method == "gptq":
            v1 = qc.get("checkpoint_format", "gptq") == "gptq"
            parts = gptq_tensors(quant, bits, v1)
        else:
            parts = awq_tensors(quant)
        tensors.update({f"{prefix}.{part}": value for part, value in parts.items()})
        expected[name] = quant.dequantize()
    _save(float_dir, out, tensors, qc, shards)
    return expected


def _save(
    float_dir: Path, out: Path, tensors: dict[str, torch.Tensor], qc: dict[str, Any], shards: int
) -> None:
    out.mkdir(parents=True)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (float_dir / extra).exists():
            shutil.copy(float_dir / extra, out / extra)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    # round-robin by tensor, so a linear's qweight, qzeros and scales land in different files
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for file in files:
        part = {n: tensors[n].contiguous() for n in names if weight_map[n] == file}
        save_file(part, str(out / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def gptq_config(**fields: Any) -> dict[str, Any]:
    """A quantization_config as GPTQModel writes it into config.json."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": True,
        "lm_head": False,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "meta": {"quantizer": ["gptqmodel:2.2.0"]},
        **fields,
    }


def awq_config(**fields: Any) -> dict[str, Any]:
    """A quantization_config as AutoAWQ writes it into config.json."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
        **fields,
    }


def write_dequantized(float_dir: Path, out: Path, dequantized: dict[str, torch.Tensor]) -> None:
    """A plain float32 Hugging Face folder holding what a quantized checkpoint stands
    for: the float model with its quantized linears replaced by their dequantization."""
    state = {
        n: t.to(torch.float32) for n, t in load_file(str(float_dir / "model.safetensors")).items()
    }
    state.update(dequantized)
    out.mkdir(parents=True)
    shutil.copy(float_dir / "config.json", out / "config.json")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

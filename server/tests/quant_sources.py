"""Quantized sources for the tests, made from the tiny float checkpoints with cadence's
own quantizers: every linear weight quantized whole (as a GPTQ/AWQ/GGUF source yields
it), and the same checkpoint with those linears replaced by their dequantized values.

Kept free of transformers imports: the tensor-parallel ranks import it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from cadence import cpu_isa as isa
from cadence.quant import crossover
from cadence.quant.formats import Int4Weight, QuantizedWeight
from cadence.quant.quantize import group_size_for, quantize_int4, quantize_int8
from safetensors.torch import load_file, save_file

LINEAR_NAMES = ("_proj.weight", "lm_head.weight")


def write_crossover(cache: Path, rows: int) -> None:
    """A crossover table in `cache` (a `$CADENCE_CACHE_DIR`) in which every quantized
    format serves at most `rows` rows, whatever the dtype and instruction set: for tests of
    the split between the quantized kernel and a kept float weight, which the built-in
    table need not have (the integer product wins at every row count)."""
    entries = {
        (fmt, dtype, name): rows
        for fmt in crossover.FORMATS
        for dtype in ("float32", "bfloat16", "float16")
        for name in (*isa.ISAS, "cuda")
    }
    crossover.write_table(entries, "test table", cache / crossover.FILE_NAME)


def is_linear(name: str) -> bool:
    return name.endswith(LINEAR_NAMES)


def quantize(w: torch.Tensor, method: str, group_size: int) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(w)
    return quantize_int4(w, group_size_for(w.shape[1], group_size))


class QuantizedCopy:
    """A float checkpoint served as a quantized source: every linear quantized whole,
    the LM head as `head_method` (default: as the others). `shift_levels` moves every
    int4 weight by that many quantization levels (a wrong centring), for the tests that
    show their bound catches one."""

    def __init__(
        self,
        model_dir: str | Path,
        method: str,
        group_size: int = 32,
        shift_levels: int = 0,
        head_method: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        (path,) = self.model_dir.glob("*.safetensors")
        self.tensors = load_file(str(path))
        self.method, self.group_size, self.shift_levels = method, group_size, shift_levels
        self.head_method = head_method or method
        self.description = f"test copy {method}"

    def float_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.tensors.items():
            if not is_linear(name):
                yield name, t

    def quantized_linears(self) -> Iterator[tuple[str, QuantizedWeight]]:
        for name, t in self.tensors.items():
            if is_linear(name):
                method = self.head_method if name == "lm_head.weight" else self.method
                w = quantize(t, method, self.group_size)
                if self.shift_levels and isinstance(w, Int4Weight):
                    w.zero += self.shift_levels * w.scale
                yield name, w


def dequantized_copy(source: QuantizedCopy, out_dir: Path) -> Path:
    """A float checkpoint folder (config and all) holding `source`'s dequantized linears."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for meta in source.model_dir.glob("*.json"):  # config, generation config
        shutil.copy(meta, out_dir / meta.name)
    tensors = dict(source.float_tensors())
    tensors |= {name: w.dequantize(torch.float32) for name, w in source.quantized_linears()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir

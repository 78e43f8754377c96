"""Which quantized source a model folder holds, if any.

A folder is pre-quantized when its config.json carries a `quantization_config` (GPTQ,
AWQ: the shape transformers and the quantizers write) or when it holds `weights.gguf`
(a llama.cpp file served as it is: the folder then carries only config.json and the
tokenizer, made from the file's metadata). Every source yields the checkpoint's float
tensors and its quantized linears in the formats of `cadence.quant.formats`, full-size;
the loader slices them per rank.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # finding out what a folder holds stays free of torch (the launcher does)
    import torch

    from cadence.quant.formats import QuantizedWeight

GGUF_WEIGHTS = "weights.gguf"  # in a model folder: the GGUF file whose weights it serves


class QuantizedSource(Protocol):
    """A checkpoint whose linears are (partly) quantized."""

    description: str  # what /info shows, e.g. "gptq int4 g128", "gguf Q4_1"

    def float_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) of every tensor kept in float: embeddings, norms,
        biases, linears the checkpoint left unquantized."""
        ...

    def quantized_linears(self) -> Iterator[tuple[str, QuantizedWeight]]:
        """(Hugging Face weight name such as "model.layers.0.self_attn.q_proj.weight",
        the whole quantized weight in Hugging Face's layout)."""
        ...


def open_quantized_checkpoint(model_dir: str | Path) -> QuantizedSource | None:
    """The quantized source in `model_dir`, None for a plain float checkpoint; raises
    naming the method for a quantization cadence cannot serve."""
    model_dir = Path(model_dir)
    if (model_dir / GGUF_WEIGHTS).exists():
        from cadence.convert.gguf import GGUFSource

        return GGUFSource(model_dir / GGUF_WEIGHTS)
    config = json.loads((model_dir / "config.json").read_text())
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        from cadence.quant.gptq import GPTQSource

        return GPTQSource(model_dir, qc)
    if method == "awq":
        from cadence.quant.awq import AWQSource

        return AWQSource(model_dir, qc)
    raise ValueError(
        f"{model_dir}/config.json: quantization_config.quant_method {method!r} is not "
        "supported (gptq, awq; or serve a .gguf file, or --quantize a float checkpoint)"
    )

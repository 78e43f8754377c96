"""Model implementations, one file per architecture family, chosen by config.json's
`model_type`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadence.models.gpt2 import GPT2Config, GPT2LMHeadModel
from cadence.models.llama import LlamaConfig, LlamaForCausalLM
from cadence.models.loader import load_weights
from cadence.models.opt import OPTConfig, OPTForCausalLM
from cadence.quant import setup as quant_setup
from cadence.quant.checkpoints import open_quantized_checkpoint
from cadence.quant.setup import QuantizeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _llama(config: dict[str, Any]) -> nn.Module:
    return LlamaForCausalLM(LlamaConfig.from_dict(config))


def _opt(config: dict[str, Any]) -> nn.Module:
    return OPTForCausalLM(OPTConfig.from_dict(config))


def _gpt2(config: dict[str, Any]) -> nn.Module:
    return GPT2LMHeadModel(GPT2Config.from_dict(config))


# config.json's model_type -> builder. Adding a family: a module in models/ written
# against cadence.layers, and one line here (see docs/models.md).
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _llama,
    "qwen3": _llama,
    "opt": _opt,
    "gpt2": _gpt2,
}


def read_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return DTYPES[dtype]


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    quantize: QuantizeConfig | None = None,
) -> nn.Module:
    """Builds the model named by config.json's `model_type` and loads its weights in
    `dtype` on `device`: a pre-quantized checkpoint's into quantized layers, a float
    one's as they are, then quantized when `quantize` asks. `model.quantization` says
    what is quantized ({} when nothing is)."""
    config = read_config(model_dir)
    model_type = config.get("model_type", "")
    build = ARCHITECTURES.get(model_type)
    if build is None:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {model_dir}/config.json "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    torch_dtype = to_dtype(dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = build(config)
    finally:
        torch.set_default_dtype(previous)
    quantize = quantize or QuantizeConfig()
    source = open_quantized_checkpoint(model_dir)
    model.checkpoint_bytes_read = 0 if source else load_weights(model, Path(model_dir))
    model.quantization = quant_setup.apply(
        model, source, quantize, torch_dtype, torch.device(device)
    )
    return model.eval()

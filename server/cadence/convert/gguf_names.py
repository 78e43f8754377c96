"""llama.cpp tensor names -> Hugging Face names, through the `gguf` package's own table.

`gguf.TensorNameMap` maps the names of many checkpoint layouts onto llama.cpp's names,
so it can only be read the other way for one layout at a time: the Hugging Face names a
checkpoint of this config holds are those cadence's own model loads (built on the meta
device: no memory), its fused products named by their parts, and each is looked up in
the table. (transformers' model class gives the same names, as the tests check, but
importing it cost a shard three seconds of its start.)
"""

from __future__ import annotations

from typing import Any

import gguf
import torch

from cadence.models.llama import LlamaConfig, LlamaForCausalLM

_SUFFIXES = (".weight", ".bias")


def hf_checkpoint_names(config: dict[str, Any]) -> list[str]:
    """The tensor names of a Hugging Face checkpoint with this config.json (a Llama-family
    one: the architectures GGUF files are read for)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    names: list[str] = []
    for name in model.state_dict():
        parts = [
            name.replace(f".{fused}.", f".{part}.")
            for part, (fused, _) in LlamaForCausalLM.packed_modules.items()
            if f".{fused}." in name
        ]
        names += parts or [name]
    return names


def gguf_to_hf_names(arch: str, n_blocks: int, hf_names: list[str]) -> dict[str, str]:
    """{llama.cpp name: Hugging Face name} for the architecture `arch` ("llama", "qwen2")."""
    arch_ids = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    table = gguf.get_tensor_name_map(arch_ids[arch], n_blocks)
    mapping: dict[str, str] = {}
    for hf_name in hf_names:
        gguf_name = table.get_name(hf_name, try_suffixes=_SUFFIXES)
        if gguf_name is not None:
            mapping[gguf_name] = hf_name
    return mapping

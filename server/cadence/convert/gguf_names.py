"""llama.cpp tensor names -> Hugging Face names, through the `gguf` package's own table.

`gguf.TensorNameMap` maps the names of many checkpoint layouts onto llama.cpp's names,
so it can only be read the other way for one layout at a time: the Hugging Face names a
checkpoint of this config holds come from transformers' own model class, built on the
meta device (no memory), and each is looked up in the table.
"""

from __future__ import annotations

from typing import Any

import gguf
import torch

_SUFFIXES = (".weight", ".bias")


def hf_checkpoint_names(config: dict[str, Any]) -> list[str]:
    """The tensor names of a Hugging Face checkpoint with this config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return list(model.state_dict())


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

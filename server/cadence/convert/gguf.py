"""Reads a llama.cpp GGUF file: Hugging Face config from its metadata, dequantized tensors."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

# llama.cpp tensor names -> Hugging Face Llama names ("{}" is the layer index).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor; None for tensors HF does not keep."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        return None
    if (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation (its rotary pairs are interleaved, HF's halved).

    llama.cpp's converter maps rows (head, half, i) to (head, i, half); this maps them back.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return (
        weight.reshape(n_heads, half, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def _scalar(value: Any) -> Any:
    """GGUF stores float32; keep the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    return value


class GGUFModel:
    """A Llama-family GGUF checkpoint opened read-only (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        self.arch = self.field("general.architecture")
        if self.arch != "llama":
            raise ValueError(f"{self.path}: architecture {self.arch!r} is not supported (llama)")

    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else _scalar(field.contents())

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def hf_config(self) -> dict[str, Any]:
        """config.json for LlamaForCausalLM, every value taken from the GGUF metadata."""
        hidden = self.arch_field("embedding_length")
        heads = self.arch_field("attention.head_count")
        kv_heads = self.arch_field("attention.head_count_kv", heads)
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "num_hidden_layers": self.arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": self.arch_field("attention.key_length", hidden // heads),
            "intermediate_size": self.arch_field("feed_forward_length"),
            "rms_norm_eps": self.arch_field("attention.layer_norm_rms_epsilon"),
            "rope_theta": self.arch_field("rope.freq_base", 10000.0),
            "max_position_embeddings": self.arch_field("context_length"),
            "vocab_size": vocab,
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            "mlp_bias": "blk.0.ffn_up.bias" in self.tensor_names,
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "rope_scaling": self._rope_scaling(),
            "use_cache": True,
        }
        return config

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = self.arch_field("rope.scaling.factor")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
        if original := self.arch_field("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = original
        return scaling

    def generation_config(self) -> dict[str, Any]:
        return {
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
        }

    def hf_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (HF name, dequantized tensor in HF layout) for every tensor HF keeps."""
        heads = self.arch_field("attention.head_count")
        kv_heads = self.arch_field("attention.head_count_kv", heads)
        for tensor in self.reader.tensors:
            name = hf_tensor_name(tensor.name)
            if name is None:
                continue
            # GGUF lists dimensions fastest-first; numpy/torch list them slowest-first.
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            weight = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
            if ".attn_q." in tensor.name:
                weight = unpermute_rotary(weight, heads)
            elif ".attn_k." in tensor.name:
                weight = unpermute_rotary(weight, kv_heads)
            yield name, weight.to(dtype)

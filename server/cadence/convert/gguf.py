"""Reads a llama.cpp GGUF file: a Hugging Face config from its metadata, and its tensors
under Hugging Face names, either served as they are (`GGUFSource`: Q4_0/Q4_1 linears as
int4) or all dequantized (`GGUFModel.hf_tensors`, for `cadence convert`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from loguru import logger

from cadence.convert.gguf_blocks import INT4_TYPES, int4_from_blocks
from cadence.convert.gguf_file import GGUFFile, GGUFTensor
from cadence.convert.gguf_names import gguf_to_hf_names, hf_checkpoint_names
from cadence.models.llama import LlamaForCausalLM
from cadence.quant.formats import Int4Weight, Int8BlockWeight

# general.architecture -> the transformers class of the same model.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Types whose values are floats already: served as they are, not "dequantized".
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
EMBEDDING = "token_embd.weight"  # always float: a lookup, not a product
Q8_0_BYTES = 34  # a Q8_0 block: its float16 scale, then 32 int8 values


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation (its rotary pairs are interleaved, HF's halved).

    llama.cpp's converter maps rows (head, half, i) to (head, i, half); this maps them back.
    Any trailing dimensions ride along, so a bias, an int4 `q` and its per-group scales
    are all unpermuted the same way.
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
    """A Llama or Qwen2 GGUF checkpoint opened read-only (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()  # a model folder's weights.gguf: the file it links
        self.file = GGUFFile(self.path)
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: architecture {self.arch!r} is not supported "
                f"({', '.join(ARCHITECTURES)})"
            )

    def field(self, key: str, default: Any = None) -> Any:
        value = self.file.field(key)
        return default if value is None else _scalar(value)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.file.tensors]

    def hf_config(self) -> dict[str, Any]:
        """config.json for the transformers model, every value taken from the GGUF metadata."""
        hidden = self.arch_field("embedding_length")
        heads = self.arch_field("attention.head_count")
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "hidden_size": hidden,
            "num_hidden_layers": self.arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_field("attention.head_count_kv", heads),
            "head_dim": self.arch_field("attention.key_length", hidden // heads),
            "intermediate_size": self.arch_field("feed_forward_length"),
            "rms_norm_eps": self.arch_field("attention.layer_norm_rms_epsilon"),
            "rope_theta": self.arch_field("rope.freq_base", 10000.0),
            "max_position_embeddings": self.arch_field("context_length"),
            "vocab_size": vocab,
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "rope_scaling": self._rope_scaling(),
            "use_cache": True,
        }
        if self.arch == "llama":  # Qwen2 always has q/k/v biases and no others
            config["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
            config["mlp_bias"] = "blk.0.ffn_up.bias" in self.tensor_names
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

    @cached_property
    def hf_names(self) -> dict[str, str]:
        """{llama.cpp tensor name: Hugging Face name} for every tensor HF keeps."""
        config = self.hf_config()
        names = hf_checkpoint_names(config)
        return gguf_to_hf_names(self.arch, config["num_hidden_layers"], names)

    def hf_tensor_items(self) -> Iterator[tuple[str, GGUFTensor]]:
        """(HF name, GGUF tensor) for every tensor HF keeps, in file order (rope_freqs and
        other llama.cpp-only tensors are left out)."""
        for tensor in self.file.tensors:
            name = self.hf_names.get(tensor.name)
            if name is None:
                logger.debug("{}: {} has no Hugging Face counterpart", self.path.name, tensor.name)
                continue
            yield name, tensor

    def rotary_heads(self, gguf_name: str) -> int | None:
        """Heads whose rows llama.cpp permuted in this tensor (llama's q and k; Qwen2's
        converter leaves them in Hugging Face order), None when it permuted nothing."""
        if self.arch != "llama":
            return None
        heads = self.arch_field("attention.head_count")
        if ".attn_q." in gguf_name:
            return heads
        if ".attn_k." in gguf_name:
            return self.arch_field("attention.head_count_kv", heads)
        return None

    def float_tensor(self, tensor: GGUFTensor) -> torch.Tensor:
        """The tensor dequantized to float32 in Hugging Face layout (exact: every GGUF
        type's values are float32-representable)."""
        values = dequantize(tensor.data, tensor.tensor_type).reshape(tensor.hf_shape)
        weight = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
        if (heads := self.rotary_heads(tensor.name)) is not None:
            weight = unpermute_rotary(weight, heads)
        return weight

    def int4_tensor(self, tensor: GGUFTensor) -> Int4Weight:
        """A Q4_0/Q4_1 tensor as it is stored, in Hugging Face row order."""
        weight = int4_from_blocks(tensor.data, tensor.tensor_type, tensor.hf_shape[0])
        if (heads := self.rotary_heads(tensor.name)) is not None:
            # Groups run along the input dimension, so whole rows move with their scales.
            weight.q, weight.scale, weight.zero = (
                unpermute_rotary(t, heads) for t in (weight.q, weight.scale, weight.zero)
            )
        return weight

    def hf_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (HF name, dequantized tensor in HF layout) for every tensor HF keeps."""
        for name, tensor in self.hf_tensor_items():
            yield name, self.float_tensor(tensor).to(dtype)


def _int4_type(tensor: GGUFTensor) -> bool:
    """Q4_0/Q4_1 linears can go to the int4 kernel as they are; embeddings stay float."""
    return tensor.tensor_type in INT4_TYPES and tensor.name != EMBEDDING


def fused_layer(hf_name: str) -> str:
    """The layer cadence's Llama fuses this checkpoint tensor into (q/k/v into one
    product, gate/up into another), else the tensor's own name."""
    for part, (fused, _) in LlamaForCausalLM.packed_modules.items():
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{fused}.")
    return hf_name


class GGUFSource:
    """A GGUF file as a `cadence.quant.checkpoints.QuantizedSource`: Q4_0/Q4_1 linears as
    `Int4Weight` (group 32) read straight from the blocks; everything else as float32
    (Q8_0's one scale per 32 values fits no per-channel int8 format, so it is dequantized,
    exactly; K-quants and other types are dequantized by gguf's reference code).

    A fused layer is one product, int4 or float: when llama.cpp stored its parts in
    different types (say q and k in Q4_0, v in Q5_1), its int4 parts are dequantized too.
    """

    def __init__(self, path: str | Path) -> None:
        self.model = GGUFModel(path)
        self.int4_names = self._int4_names()  # GGUF names of the tensors served as int4
        self.description = self._describe()

    def _int4_names(self) -> set[str]:
        layers: dict[str, list[GGUFTensor]] = {}
        for name, tensor in self.model.hf_tensor_items():
            layers.setdefault(fused_layer(name), []).append(tensor)
        names: set[str] = set()
        for layer, parts in layers.items():
            if all(_int4_type(t) for t in parts):
                names.update(t.name for t in parts)
            elif any(_int4_type(t) for t in parts):
                logger.info(
                    "{}: {} mixes {}: served as float32",
                    self.model.path.name,
                    layer,
                    ", ".join(f"{t.name} {t.tensor_type.name}" for t in parts),
                )
        return names

    def _describe(self) -> str:
        """ "gguf Q4_1", or e.g. "gguf Q4_0, Q6_K as float" when some linears are served
        dequantized; logs those. (The embedding is a float table whatever its type.)"""
        int4: Counter[str] = Counter()
        as_float: Counter[str] = Counter()
        for _, tensor in self.model.hf_tensor_items():
            kind = tensor.tensor_type.name
            if tensor.name in self.int4_names:
                int4[kind] += 1
            elif tensor.name != EMBEDDING and tensor.tensor_type not in (*INT4_TYPES, *FLOAT_TYPES):
                as_float[kind] += 1
        for kind, count in as_float.items():
            logger.info(
                "{}: {} {} tensor(s) served dequantized to float32 (no kernel for that type)",
                self.model.path.name,
                count,
                kind,
            )
        parts = [kind for kind, _ in int4.most_common()]
        parts += [f"{kind} as float" for kind, _ in as_float.most_common()]
        return " ".join(["gguf", ", ".join(parts) or "float"])

    def embedding_int8_blocks(self) -> Int8BlockWeight | None:
        """The embedding table as stored when it is Q8_0 (None otherwise): llama.cpp
        multiplies a tied LM head by these blocks, and so does the shard where the integer
        product serves (`cadence.quant.load.serve_tied_head_in_blocks`)."""
        for tensor in self.model.file.tensors:
            if tensor.name == EMBEDDING and tensor.tensor_type == GGMLQuantizationType.Q8_0:
                blocks = np.asarray(tensor.data).reshape(-1, Q8_0_BYTES)
                scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
                q = blocks[:, 2:].copy().view(np.int8)
                rows = tensor.hf_shape[0]
                return Int8BlockWeight(
                    torch.from_numpy(q).reshape(rows, -1),
                    torch.from_numpy(scale).reshape(rows, -1),
                )
        return None

    def float_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.hf_tensor_items():
            if tensor.name not in self.int4_names:
                yield name, self.model.float_tensor(tensor)

    def quantized_linears(self) -> Iterator[tuple[str, Int4Weight]]:
        for name, tensor in self.model.hf_tensor_items():
            if tensor.name in self.int4_names:
                yield name, self.model.int4_tensor(tensor)

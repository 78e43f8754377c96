"""Typed configuration, built once from the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ShardConfig:
    """What one shard process needs: which model, where to listen, how much memory."""

    model_dir: str  # a local Hugging Face folder (config.json, *.safetensors)
    uds_path: str  # unix socket the gRPC server listens on
    dtype: str = "auto"  # "float32" | "bfloat16" | "float16" | "auto" (isa.default_dtype)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    block_size: int = 16  # tokens per KV block
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    kv_cache_dtype: str | None = None  # None: follow dtype
    log_format: str = "text"  # "text" | "json"
    model_id: str = ""  # reported by Info; "" = model_dir
    cpu_isa: str = "auto"  # the C++ kernels' instruction set: "auto" or one of isa.ISAS
    attention_backend: str = "auto"  # "auto" | "torch" | "cpu" | "triton"
    cpu_kernels: bool = True  # False: the layers run torch, no C++ kernel, no prepacking

"""Fixtures: tiny random models of each supported architecture, built with transformers
and saved as safetensors, and a small driver that plays the router's part."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# (TRITON_INTERPRET is set by the root conftest, before cadence is imported)

from cadence.config import ShardConfig  # noqa: E402
from cadence.shard.engine import Engine  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)

# The same tiny sizes in OPT's and GPT-2's vocabulary.
TINY_OPT = dict(
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=256,
    max_position_embeddings=64,  # a small position table: the layers dominate, as in real OPT
    word_embed_proj_dim=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_GPT2 = dict(
    n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=1, eos_token_id=2
)

# name -> (config class, base sizes, overrides)
VARIANTS: dict[str, tuple[type, dict, dict]] = {
    "llama_gqa": (LlamaConfig, TINY, {}),
    "llama_mha_tied": (LlamaConfig, TINY, {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama_bias": (LlamaConfig, TINY, {"attention_bias": True}),
    "llama3_rope": (
        LlamaConfig,
        TINY,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "qwen2": (Qwen2Config, TINY, {"tie_word_embeddings": True}),
    # per-head q/k RMSNorm, and a head_dim (32) that is not hidden_size / heads (16)
    "qwen3": (Qwen3Config, TINY, {"head_dim": 32}),
    # one KV head: fewer KV heads than 2 shards (replicated); a vocabulary of 257 rows
    "llama_kv1_odd_vocab": (LlamaConfig, TINY, {"num_key_value_heads": 1, "vocab_size": 257}),
    # SmolLM2-135M's head layout: 9 query heads in 3 KV groups, uneven over 2 ranks
    "llama_9_heads_3_kv": (
        LlamaConfig,
        TINY,
        {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3},
    ),
    # head_dim 64 and widths that are multiples of 16: the C++ kernels' bfloat16 vector paths
    "llama_head_dim_64": (
        LlamaConfig,
        TINY,
        {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4},
    ),
    "mistral_window": (MistralConfig, TINY, {"sliding_window": 8}),
    "qwen2_window": (
        Qwen2Config,
        TINY,
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "opt": (OPTConfig, TINY_OPT, {}),
    # opt-350m's shape: LayerNorm after each block, project_in/out around a narrower
    # embedding, no final LayerNorm; and an odd vocabulary
    "opt_350m": (
        OPTConfig,
        TINY_OPT,
        {"do_layer_norm_before": False, "word_embed_proj_dim": 32, "vocab_size": 257},
    ),
    "gpt2": (GPT2Config, TINY_GPT2, {}),
}


def _build(name: str, root: Path) -> Path:
    cls, base, overrides = VARIANTS[name]
    torch.manual_seed(0)
    config = cls(**{**base, **overrides})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the default init: sharper distributions
        for p in model.parameters():
            p.normal_(0, 0.15 if p.dim() > 1 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = _build(name, root)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], PreTrainedModel]:
    cache: dict[Path, PreTrainedModel] = {}

    def get(path: Path) -> PreTrainedModel:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


def make_engine(
    model_dir: Path, num_blocks: int = 64, dtype: str = "float32", **config: Any
) -> Engine:
    """An engine with its KV cache allocated; `config`: more ShardConfig fields."""
    engine = Engine(ShardConfig(model_dir=str(model_dir), uds_path="", dtype=dtype, **config))
    engine.warmup(
        max_batch_tokens=64,
        max_batch_size=8,
        kv_cache_bytes=num_blocks * engine.bytes_per_block,
    )
    return engine


@pytest.fixture(scope="session")
def engine_for() -> Callable[..., Engine]:
    return make_engine


@pytest.fixture(scope="module")
def avx512_bf16() -> Iterator[None]:
    """The avx512_bf16 kernels selected: the only ones with the AMX products
    (test_quant_amx_kernel.py, test_bf16_amx_kernel.py)."""
    from cadence.kernels import cpu
    from cadence.kernels.cpu import amx_check

    why_not = cpu.not_selectable(amx_check.ISA)
    if why_not:
        pytest.skip(why_not)
    with cpu.selected(amx_check.ISA):
        yield


@pytest.fixture(scope="module")
def amx_int8_hardware(avx512_bf16: None) -> None:
    """AMX-INT8's instructions run in this process only once the self-test has run them in
    a process of its own: a CPU or hypervisor that mishandles AMX kills that one (a failure
    here naming why), not the test session (test_quant_amx_kernel.py,
    test_attention_amx_kernel.py)."""
    import torch
    from cadence.kernels.cpu import amx_check

    if not torch.ops.cadence.amx_available():
        pytest.skip(amx_check.no_amx_reason())
    ok, why = amx_check.usable(timeout_s=600)
    if not ok:
        pytest.fail(f"this CPU grants AMX-INT8 but the AMX products fail their self-test: {why}")

"""Chooses, once per engine, what computes a shard's step: the C++ CPU kernels' build,
the quantized weights' products, the attention backend, the layers' per-op kernels, the
model runner and the LoRA delta's products (`Kernels`, the registry the engine hands on).
The one place that maps names (the `--attention-backend` flag, devices, instruction
sets) to implementations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger
from torch import nn

from cadence.attention_backends import AttentionBackend
from cadence.attention_backends.base import Workspace
from cadence.attention_backends.cpu_paged import CpuAttention
from cadence.attention_backends.torch_sdpa import TorchAttention
from cadence.config import ATTENTION_BACKENDS, ShardConfig
from cadence.kernels import INTERPRETED as triton_interpreted
from cadence.kernels import cpu as cpu_kernels
from cadence.kernels import triton_available
from cadence.layers.kernel_ops import TORCH_OPS, LayerOps, cpu_ops, triton_ops
from cadence.models.llama import LlamaForCausalLM
from cadence.quant.cpu_gemm import integer_product_is_fast
from cadence.quant.product import ProductKernels
from cadence.runners import LlamaCpuFlatRunner, ModelRunner


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """Whether the C++ CPU kernels serve this shard, and why not when they do not."""

    on: bool
    reason: str = ""  # why they are off


@dataclass(frozen=True, slots=True)
class LoraKernels:
    """What computes the LoRA delta: the Triton kernels (beside the triton attention
    backend), else torch, with the C++ row kernels for an adapter's few rows when the CPU
    kernels serve."""

    triton: bool
    cpu_rows: bool


@dataclass(frozen=True, slots=True)
class Kernels:
    """Everything that computes a shard's steps, chosen once (`choose`)."""

    cpu: CpuKernels
    products: ProductKernels  # quantized weights' (chosen before the model loads)
    attention: AttentionBackend[Any]
    ops: LayerOps
    runner: ModelRunner
    lora: LoraKernels


def cpu_kernels_for(cfg: ShardConfig, device: torch.device) -> CpuKernels:
    """Selects the C++ kernels' instruction set on a CPU device -- once, before the model
    is built: every CPU kernel call runs this choice -- and says whether they serve."""
    if device.type != "cpu":
        return CpuKernels(False, "not on a CPU device")
    try:
        cpu_kernels.select(cfg.cpu_isa)
    except cpu_kernels.KernelBuildError as err:
        logger.warning(f"C++ CPU kernels unavailable, serving through torch: {err}")
        return CpuKernels(False, str(err))
    return CpuKernels(cfg.cpu_kernels, "turned off (--no-cpu-kernels)")


def product_kernels(device: torch.device) -> ProductKernels:
    """Quantized weights' products: Triton's on CUDA; on CPU the C++ integer product where
    the selected instruction set makes it the fast path (`cpu_kernels_for` selected it),
    else torch's weight-only kernels."""
    if device.type == "cuda":
        return ProductKernels.TRITON
    if device.type == "cpu" and integer_product_is_fast(cpu_kernels.selected_isa() or ""):
        return ProductKernels.CPU_INTEGER
    return ProductKernels.CPU_TORCH


def choose(
    requested_attention: str,
    device: torch.device,
    cpu: CpuKernels,
    products: ProductKernels,
    model: nn.Module,
    deterministic: bool = False,
) -> Kernels:
    """The registry of a loaded model's kernels: see `attention_backend`, `layer_ops` and
    `model_runner`; the LoRA delta through Triton exactly when the attention is.
    `deterministic`: the cpu backend attends every query over the cache."""
    attention = attention_backend(requested_attention, device, cpu, Workspace(), deterministic)
    lora = LoraKernels(triton=attention.name == "triton", cpu_rows=cpu.on)
    ops = layer_ops(device, attention, cpu)
    return Kernels(cpu, products, attention, ops, model_runner(model, attention), lora)


def attention_backend(
    requested: str,
    device: torch.device,
    cpu: CpuKernels,
    workspace: Workspace,
    every_query_on_cache: bool = False,
) -> AttentionBackend[Any]:
    """`auto`: triton on CUDA when triton imports; on CPU `cpu` when the C++ kernels
    serve, else torch. `triton` on a CPU device needs `TRITON_INTERPRET=1` (tests only:
    the interpreter is slow)."""
    requested = requested.lower()
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {requested!r} (one of {', '.join(ATTENTION_BACKENDS)})"
        )
    if requested == "auto":
        if device.type == "cpu":
            requested = "cpu" if cpu.on else "torch"
        else:
            requested = "triton" if device.type == "cuda" and triton_available() else "torch"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on CPU devices only")
        if not cpu.on:
            raise ValueError(f"the cpu attention backend is unavailable: {cpu.reason}")
        return CpuAttention(workspace, every_query_on_cache)
    if requested == "triton":
        if device.type != "cuda" and not triton_interpreted:
            raise ValueError("the triton attention backend on CPU needs TRITON_INTERPRET=1")
        from cadence.attention_backends.triton_paged import TritonAttention  # imports triton

        return TritonAttention()
    return TorchAttention(workspace)


def layer_ops(device: torch.device, attention: AttentionBackend[Any], cpu: CpuKernels) -> LayerOps:
    """The C++ kernels where they serve; Triton's on CUDA (and beside the triton backend
    under the interpreter); torch otherwise."""
    if cpu.on:
        isa = cpu_kernels.selected_isa()
        assert isa is not None
        return cpu_ops(isa)
    if attention.name == "triton" or (device.type == "cuda" and triton_available()):
        return triton_ops()
    return TORCH_OPS


def model_runner(model: nn.Module, attention: AttentionBackend[Any]) -> ModelRunner:
    """The flat CPU step for the Llama family under the cpu backend (weights of one dtype
    the C++ kernels take); the model's own forward otherwise."""
    if (
        isinstance(model, LlamaForCausalLM)
        and isinstance(attention, CpuAttention)
        and model.model.embed_tokens.weight.dtype in cpu_kernels.DTYPES
        and model.model.norm.weight.dtype == model.model.embed_tokens.weight.dtype
    ):
        return LlamaCpuFlatRunner(model, attention)
    return ModelRunner(model, attention)

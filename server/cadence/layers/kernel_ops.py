"""The per-op kernels of the layers (RMSNorm, SwiGLU, rotary) and of greedy sampling,
chosen once per engine and bound into the model's modules at build (`bind`).

`TORCH_OPS` is what a module runs until bound: plain torch, any device. `cpu_ops()` takes
the C++ kernels of `cadence.kernels.cpu` where a call's layout fits them (each keeps the
torch path for the layouts it does not take); `triton_ops()` the Triton RMSNorm and
rotary kernels of `cadence.kernels`. Every variant computes the same rounding steps as the
torch one (the kernel tests compare them), so which is bound changes speed, not output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# (x, weight, eps, residual) -> (norm(x [+ residual]), x + residual or None)
RmsNormFn = Callable[
    [torch.Tensor, torch.Tensor, float, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | None],
]
SiluMulFn = Callable[[torch.Tensor], torch.Tensor]
# (x [T, heads, head_dim], cos, sin) -> x rotated (in place where the kernel can)
RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# logits [R, vocab] -> (argmax ids, their log-probabilities)
GreedyFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class LayerOps:
    rms_norm: RmsNormFn
    silu_mul: SiluMulFn
    rotary: RotaryFn
    greedy: GreedyFn | None  # None: the sampler's own argmax + log_softmax
    norms: str  # what serves the norms, SwiGLU and rotary (the shard's kernel report)
    sampling: str  # what serves sampling


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Llama's RMSNorm: the residual sum in the input dtype, normalized in float32, cast
    back, then scaled by the weight."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed, (x if residual is not None else None)


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half rotary of Hugging Face Llama; a new tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


TORCH_OPS = LayerOps(
    rms_norm=rms_norm_torch,
    silu_mul=silu_mul_torch,
    rotary=rotary_torch,
    greedy=None,
    norms="torch",
    sampling="torch",
)


def cpu_ops(isa: str) -> LayerOps:
    """The C++ kernels of `isa` (already selected in `cadence.kernels.cpu`)."""
    from cadence.kernels import cpu

    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if x.dim() == 2 and x.dtype == weight.dtype and x.dtype in cpu.DTYPES:
            return cpu.rms_norm(x, weight, eps, residual)
        return rms_norm_torch(x, weight, eps, residual)

    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype in cpu.DTYPES:
            return cpu.silu_mul(x)
        return silu_mul_torch(x)

    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        heads_packed = x.stride(2) == 1 and x.stride(1) == x.shape[2]
        if heads_packed and x.dtype in cpu.DTYPES and cos.dtype == x.dtype:
            return cpu.rotary_(x, cos, sin)
        return rotary_torch(x, cos, sin)

    def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16):
            return cpu.greedy_logprobs(logits)
        return cpu.greedy_logprobs_ref(logits)

    return LayerOps(
        rms_norm=rms_norm,
        silu_mul=silu_mul,
        rotary=rotary,
        greedy=greedy,
        norms=f"C++ {isa}",
        sampling=f"C++ {isa} greedy, torch otherwise",
    )


def triton_ops() -> LayerOps:
    """Triton's fused residual + RMSNorm and in-place rotary (imports triton)."""
    from cadence.kernels.rmsnorm import rmsnorm
    from cadence.kernels.rotary import rotary_

    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if x.dim() != 2 or x.stride(-1) != 1:
            return rms_norm_torch(x, weight, eps, residual)
        if residual is None:
            return rmsnorm(x, weight, eps), None  # type: ignore[return-value]
        out, new_residual = rmsnorm(x, weight, eps, residual.contiguous())
        return out, new_residual

    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.stride(-1) == 1 and cos.dtype == x.dtype:
            return rotary_(x, cos, sin)
        return rotary_torch(x, cos, sin)

    return LayerOps(
        rms_norm=rms_norm,
        silu_mul=silu_mul_torch,
        rotary=rotary,
        greedy=None,
        norms="triton norms + rotary, torch SwiGLU",
        sampling="torch",
    )


class UsesLayerOps:
    """A module whose arithmetic is one of `LayerOps`' (torch until `bind` runs)."""

    ops: LayerOps = TORCH_OPS


def bind(model: nn.Module, ops: LayerOps) -> None:
    """Binds `ops` into every module of `model` that takes its kernels from them."""
    for module in model.modules():
        if isinstance(module, UsesLayerOps):
            module.ops = ops

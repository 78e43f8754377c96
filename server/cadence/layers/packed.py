"""Linear weights prepacked for oneDNN on CPU.

`F.linear` on a bfloat16 CPU tensor reorders the weight into oneDNN's blocked layout on
every call; for a decode-sized batch (a few dozen rows) that reorder costs as much as the
product itself. `pack_linear_weights` stores each linear weight once more in the blocked
layout, and `linear` uses it up to 320 rows (1.4x faster than `F.linear` from 32 to 320
rows on SmolLM2's shapes); from ~350 rows oneDNN takes another path and the two are
equal, so larger batches (prefill chunks) keep `F.linear`. Only bfloat16 on CPU, where
torch has the oneDNN ops; `CADENCE_CPU_KERNELS=0` turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MAX_ROWS = 320  # rows up to which the packed weight is used (kernels/cpu_linear_bench.py)
_PACK_HINT_ROWS = 32  # the batch size oneDNN chooses the blocked layout for


def packing_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and os.environ.get("CADENCE_CPU_KERNELS", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linear_weights(model: nn.Module) -> int:
    """Gives every module with a `packed_weight` slot its packed copy; returns the bytes
    added. Call after the weights are loaded (and tied)."""
    added = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        weight = module.weight
        if not packing_supported(weight):
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.data.contiguous(), _PACK_HINT_ROWS
        )
        added += weight.numel() * weight.element_size()
    return added


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
) -> torch.Tensor:
    """F.linear, through the packed weight when there is one and the batch is small."""
    if packed is not None and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)

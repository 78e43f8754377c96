"""Linear weights prepacked for oneDNN on CPU.

`F.linear` on a CPU tensor reorders (bfloat16, through oneDNN) or packs (float32,
through MKL's sgemm) the weight on every call; for a decode-sized batch (a few dozen
rows) that costs as much as the product itself. `pack_linear_weights` stores each linear
weight once more in oneDNN's blocked layout, and `linear` multiplies through it:

- bfloat16 up to 320 rows (1.4x faster than `F.linear` from 32 to 320 rows on SmolLM2's
  shapes); from ~350 rows oneDNN takes another path and the two are equal, so larger
  batches (prefill chunks) keep `F.linear`. Only where the CPU kernels run with AVX-512:
  oneDNN refuses to prepack bfloat16 on CPUs without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT).
- float32 at every batch size: SmolLM2's 30 layers and LM head with oneDNN and MKL held to
  AVX2 take 1.9x less time than `F.linear` at 1 row, 1.6x at 32, 1.2x at 1024
  (`benchmarks/kernels/cpu_linear_bench.py --dtype float32`).

Batch-invariant serving (`every_row_count`) multiplies bfloat16 through the packed weight
at every row count too: oneDNN's prepacked product gives each row the same bits whatever
the number of rows (`cadence.shard.determinism` checks it at start), `F.linear` does not.

Each dtype is tried once on a tiny weight before any model weight is packed.
Off with the C++ kernels (`--no-cpu-kernels`).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from cadence.kernels import cpu as cpu_kernels

BF16_PACKED_MAX_ROWS = 320  # bf16 rows up to which the packed weight is used
EVERY_ROW_COUNT = 1 << 30
_PACK_HINT_ROWS = 32  # the batch size oneDNN chooses the blocked layout for


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks and multiplies a weight of `dtype` on this CPU (tried once)."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
        x = torch.ones(2, 16, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def packing_supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return onednn_packs(torch.float32)
    return (
        weight.dtype == torch.bfloat16
        and cpu_kernels.available()
        and cpu_kernels.selected_isa() in ("avx512_bf16", "avx512")
        and onednn_packs(torch.bfloat16)
    )


def pack_linear_weights(
    model: nn.Module, enabled: bool = True, every_row_count: bool = False
) -> int:
    """Gives every module with a `packed_weight` slot its packed copy (when `enabled`),
    read by products of up to `packed_max_rows` rows: every row count for float32 or when
    `every_row_count`, else BF16_PACKED_MAX_ROWS; returns the bytes added. Call after the
    weights are loaded (and tied)."""
    added = 0
    if not enabled:
        return added
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        weight = module.weight
        if weight.numel() == 0 or not packing_supported(weight):  # 0: quantized, no float kept
            continue
        quantized = getattr(module, "quantized", None)
        if quantized is not None and quantized.serves_every_row_count:
            continue  # a float kept only as a tied table: no product reads it
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.data.contiguous(), _PACK_HINT_ROWS
        )
        every = every_row_count or weight.dtype is torch.float32
        module.packed_max_rows = EVERY_ROW_COUNT if every else BF16_PACKED_MAX_ROWS
        added += weight.numel() * weight.element_size()
    return added


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    packed_max_rows: int | None = None,
) -> torch.Tensor:
    """F.linear, through the packed weight when there is one and `x` has at most
    `packed_max_rows` rows (None: every row count for float32, BF16_PACKED_MAX_ROWS for
    bfloat16)."""
    if packed_max_rows is None:
        every = x.dtype is torch.float32
        packed_max_rows = EVERY_ROW_COUNT if every else BF16_PACKED_MAX_ROWS
    if packed is not None and x.dim() == 2 and x.shape[0] <= packed_max_rows:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)

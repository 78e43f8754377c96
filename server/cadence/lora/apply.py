"""The LoRA delta of a linear layer, added by `cadence.layers.linear.product`.

Each of the served model's linear layers gets a `LoraHook` at engine build (the draft
model's get none: it never applies adapters). The hook reads the engine's `LoraContext`:
the pool's rows and the step's tables (`LoraStep`, None for a step whose requests use no
adapter, so a step without adapters costs one attribute test per product). A
row-parallel layer's delta is added to its partial output, before the all-reduce: its A
holds this rank's input columns and its B is whole, so the ranks' deltas sum to the
full one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cadence.lora.batch import LoraStep, StepKind, StepPiece
from cadence.lora.pool import PoolRows
from cadence.lora.products import ExpandTables, ShrinkTables
from cadence.lora.resident import Site, layer_sites
from cadence.lora.torch_ops import lora_expand_, lora_shrink


@dataclass(slots=True)
class LoraContext:
    """What the hooks read: the pool (None before the KV cache exists) and the step;
    `cpu_kernels`: whether the C++ CPU kernels serve (the per-row products through them);
    `triton`: whether the products run through the Triton kernels (`cadence.kernels.lora`,
    the steps then carry their row plan)."""

    pool: PoolRows | None = None
    step: LoraStep | None = None
    cpu_kernels: bool = False
    triton: bool = False


@dataclass(frozen=True, slots=True)
class LoraHook:
    name: str
    site: Site
    context: LoraContext

    def add_delta_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += this layer's LoRA delta for the step's rows of x (y: its base product)."""
        step, pool = self.context.step, self.context.pool
        if step is None or pool is None:
            return
        kind = step.kinds.get(self.site.kind)
        layer = self.site.index
        if kind is None or not kind.a.active[layer]:
            return
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        a = kind.a
        shrink = ShrinkTables(
            pool.rows(kind.in_features), a.rows[layer], a.ranks[layer], step.row_adapter
        )
        if step.row_plan is not None:
            _triton_delta_(x2, y2, shrink, pool, kind, layer, step)
            return
        h = lora_shrink(x2, shrink, step.segments, self.context.cpu_kernels)
        for piece in kind.pieces:
            if piece.index.active[layer]:
                expand = _expand_tables(pool, piece, layer, step)
                lora_expand_(y2, h, expand, step.segments, self.context.cpu_kernels)


def _expand_tables(pool: PoolRows, piece: StepPiece, layer: int, step: LoraStep) -> ExpandTables:
    b = piece.index
    return ExpandTables(
        pool.rows(piece.out_size), b.rows[layer], b.ranks[layer], b.rank_start[layer],
        piece.out_offset, step.row_adapter,
    )  # fmt: skip


def _triton_delta_(
    x: torch.Tensor,
    y: torch.Tensor,
    shrink: ShrinkTables,
    pool: PoolRows,
    kind: StepKind,
    layer: int,
    step: LoraStep,
) -> None:
    """The hook's products through the Triton kernels, over the step's row plan."""
    from cadence.kernels import lora as triton_lora  # imports triton

    h = triton_lora.lora_shrink(x, shrink, step.row_plan)
    for piece in kind.pieces:
        if piece.index.active[layer]:
            triton_lora.lora_expand_(y, h, _expand_tables(pool, piece, layer, step), step.row_plan)


def install(model: nn.Module, context: LoraContext) -> dict[str, Site]:
    """Gives each linear layer of `model` its hook; returns the layers' sites."""
    sites = layer_sites(model)
    modules = dict(model.named_modules())
    for name, site in sites.items():
        modules[name].lora = LoraHook(name, site, context)
    return sites

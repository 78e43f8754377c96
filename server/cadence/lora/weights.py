"""An adapter's weights as one rank applies them, whatever checkpoint they came from.

A LoRA layer adds `scaling · (x Aᵀ) Bᵀ` to a linear layer's output. cadence fuses
projections that share an input (q/k/v, gate/up, GPT-2's `c_attn`), so one of its
layers may carry several PEFT modules: their A matrices are stacked into one shrink
(`LayerLora.a`, one product for all of them), and each module's B writes its own range of
the layer's output (`ExpandPiece`). Weights are this rank's slices (column-parallel
layers: B's rows of this rank's outputs; row-parallel layers: A's columns of this rank's
inputs, B whole, added before the all-reduce), in the model's dtype, the scaling (alpha/r,
or alpha/sqrt(r) with rsLoRA) folded into B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpandPiece:
    """One PEFT module's B on this rank: the layer's outputs
    `[out_offset, out_offset + b_t.shape[1])` get `h[:, rank_start : rank_start + r] @ b_t`."""

    out_offset: int  # first output feature of this rank's layer output it writes
    rank_start: int  # first column of the shrink output (row of `LayerLora.a`) it reads
    b_t: torch.Tensor  # [r, out_size]: Bᵀ with the scaling folded in


@dataclass(frozen=True, slots=True)
class LayerLora:
    """The adapter on one of the model's linear layers (on this rank)."""

    a: torch.Tensor  # [total rank, in_features of this rank's layer]: stacked A rows
    pieces: tuple[ExpandPiece, ...]

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(p.b_t.nbytes for p in self.pieces)


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A parsed adapter, ready to be paged in. `layers` maps the qualified name of one of
    the model's `LinearBase` modules (as `model.named_modules()` gives it, e.g.
    `model.layers.3.self_attn.qkv_proj`) to its LoRA; layers the adapter leaves alone are
    absent."""

    name: str
    path: str
    layers: dict[str, LayerLora]
    max_rank: int
    target_modules: tuple[str, ...]  # the checkpoint's module names it adapts (q_proj, ...)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())

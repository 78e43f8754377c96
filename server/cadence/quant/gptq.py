"""GPTQ checkpoints (AutoGPTQ, GPTQModel, Optimum) as a `QuantizedSource`.

Each quantized linear `<prefix>` stores, in Hugging Face's [out, in] terms:
- `qweight` int32 [in * bits / 32, out]: 32 / bits values per word along the input
  dimension, the first in the lowest bits;
- `qzeros` int32 [groups, out * bits / 32]: the integer zero points, packed the same
  way along the output dimension. Format "gptq" (v1) stores `z - 1` (so a stored 15
  reads as 16); "gptq_v2" stores `z`;
- `scales` float [groups, out]; `g_idx` int32 [in]: the group of each input column
  (absent in old checkpoints: `i // group_size`);
and `w[o, i] = (q[o, i] - z[o, g]) * s[o, g]` with `g = g_idx[i]`. With act-order
(`desc_act`) `g_idx` is a shuffle; sorting the columns by group (stable) makes the groups
contiguous again, and that order is the `Int4Weight`'s `perm`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cadence.quant.formats import Int8Weight, QuantizedWeight
from cadence.quant.int_packing import int4_with_zero_points, unpack_int32
from cadence.quant.tensor_files import TensorFiles, quantized_prefixes

PARTS = ("qweight", "qzeros", "scales", "g_idx")
FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what to add to a stored zero
INT8_SYMMETRIC_ZERO = 128


class GPTQSource:
    """The tensors of a GPTQ model folder; `quantization_config` from its config.json."""

    def __init__(self, model_dir: Path, quantization_config: dict[str, Any]) -> None:
        self.model_dir = Path(model_dir)
        qc = quantization_config
        self._where = f"{self.model_dir}/config.json: quantization_config"
        if qc.get("is_marlin_format"):
            raise ValueError(f"{self._where}.is_marlin_format: Marlin-packed GPTQ is not supported")
        # GPTQModel names the field "format"; AutoGPTQ, Optimum and transformers
        # "checkpoint_format"
        field = "checkpoint_format" if qc.get("checkpoint_format") else "format"
        fmt = str(qc.get(field) or "gptq").lower()
        if fmt not in FORMATS:
            raise ValueError(f"{self._where}.{field} {fmt!r} is not supported (gptq, gptq_v2)")
        self._zero_offset = FORMATS[fmt]
        pack_dtype = str(qc.get("pack_dtype", "int32"))
        if pack_dtype != "int32":
            raise ValueError(f"{self._where}.pack_dtype {pack_dtype!r} is not supported (int32)")
        self._base = {
            "bits": qc.get("bits"),
            "group_size": qc.get("group_size", -1),
            "sym": qc.get("sym", True),
        }
        self._dynamic: dict[str, dict[str, Any]] = dict(qc.get("dynamic") or {})
        self._check_layout(self._base, "")
        for rule, override in self._dynamic.items():
            if not rule.startswith("-:"):
                self._check_layout({**self._base, **override}, f".dynamic[{rule!r}]")
        self.files = TensorFiles(self.model_dir)
        self._prefixes = quantized_prefixes(self.files.names())
        bits, group = self._base["bits"], self._base["group_size"]
        groups = "per-channel" if group == -1 else f"g{group}"
        self.description = f"gptq int{bits} {groups}" + (" desc_act" if qc.get("desc_act") else "")

    def _check_layout(self, layout: dict[str, Any], field: str) -> None:
        """Refuses, naming the field, what cadence's two formats cannot hold exactly."""
        bits = layout["bits"]
        if bits not in (4, 8):
            raise ValueError(
                f"{self._where}{field}.bits {bits!r} is not supported (4; 8 when symmetric "
                "with group_size -1)"
            )
        if bits == 8 and not (layout["sym"] and layout["group_size"] == -1):
            raise ValueError(
                f"{self._where}{field}: 8-bit GPTQ is served only with sym true and "
                f"group_size -1 (one scale per output channel), found sym "
                f"{layout['sym']!r}, group_size {layout['group_size']!r}"
            )

    def _layout_of(self, prefix: str) -> dict[str, Any] | None:
        """The module's bits/group_size/sym after GPTQModel's `dynamic` rules (regexes
        matched from the start of the module name, first match wins; "-:" = left in
        float); None when a rule leaves it unquantized."""
        for rule, override in self._dynamic.items():
            if rule.startswith("-:"):
                if re.match(rule[2:], prefix):
                    return None
            elif re.match(rule.removeprefix("+:"), prefix):
                return {**self._base, **override}
        return self._base

    def float_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        quantized = {f"{p}.{part}" for p in self._prefixes for part in PARTS}
        yield from self.files.each(n for n in self.files.names() if n not in quantized)

    def quantized_linears(self) -> Iterator[tuple[str, QuantizedWeight]]:
        for prefix in self._prefixes:
            layout = self._layout_of(prefix)
            if layout is None:
                raise ValueError(
                    f"{self.model_dir}: {prefix} is packed but quantization_config.dynamic "
                    "excludes it from quantization"
                )
            yield f"{prefix}.weight", self._read(prefix, layout)

    def _read(self, prefix: str, layout: dict[str, Any]) -> QuantizedWeight:
        bits = layout["bits"]
        for part in PARTS[:3]:
            if f"{prefix}.{part}" not in self.files:
                raise ValueError(f"{self.model_dir}: {prefix}.qweight has no {prefix}.{part}")
        scales = self.files.get(f"{prefix}.scales")  # [groups, out]
        groups, out_features = scales.shape
        # packed along the input: unpack the transpose so the input is the last dim
        q = unpack_int32(self.files.get(f"{prefix}.qweight").t().contiguous(), bits)  # [out, in]
        zeros = unpack_int32(self.files.get(f"{prefix}.qzeros"), bits)[:, :out_features]
        zeros = zeros + self._zero_offset  # [groups, out]
        in_features = q.shape[1]
        if in_features % groups:
            raise ValueError(
                f"{self.model_dir}: {prefix} has {in_features} input columns in {groups} "
                "groups; cadence serves only groups of equal size"
            )
        group_size = in_features // groups
        if layout["group_size"] not in (-1, group_size):
            raise ValueError(
                f"{self.model_dir}: {prefix} holds groups of {group_size} columns, "
                f"quantization_config.group_size says {layout['group_size']}"
            )
        perm = self._act_order(prefix, in_features, group_size)
        if perm is not None:
            q = q[:, perm]
        if bits == 8:
            return self._int8(prefix, q, zeros, scales)
        return int4_with_zero_points(q, zeros.t(), scales.t(), perm)

    def _act_order(self, prefix: str, in_features: int, group_size: int) -> torch.Tensor | None:
        """The column order that makes `g_idx`'s groups contiguous; None when they are."""
        contiguous = torch.arange(in_features) // group_size
        name = f"{prefix}.g_idx"
        if name not in self.files:
            return None
        g_idx = self.files.get(name).to(torch.int64)
        if torch.equal(g_idx, contiguous):
            return None
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError(
                f"{self.model_dir}: {name} does not give every group {group_size} columns"
            )
        return perm

    def _int8(
        self, prefix: str, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
    ) -> Int8Weight:
        if scales.shape[0] != 1 or not bool((zeros == INT8_SYMMETRIC_ZERO).all()):
            raise ValueError(
                f"{self.model_dir}: 8-bit {prefix} is not symmetric with one group "
                f"(zero points must all be {INT8_SYMMETRIC_ZERO})"
            )
        return Int8Weight(
            (q - INT8_SYMMETRIC_ZERO).to(torch.int8), scales[0].to(torch.float32).contiguous()
        )

"""AWQ checkpoints in AutoAWQ's GEMM packing as a `QuantizedSource`.

Each quantized linear `<prefix>` stores, transposed against Hugging Face's [out, in]:
- `qweight` int32 [in, out / 8]: 8 int4 values per word along the output dimension,
  nibble k (bits 4k..4k+3) holding output column `8 * word + ORDER[k]`;
- `qzeros` int32 [groups, out / 8]: the integer zero points, packed the same way;
- `scales` float [groups, out];
and `w[o, i] = (q[i, o] - z[g, o]) * s[g, o]` with `g = i // group_size`. AutoAWQ's GEMV
and Marlin layouts and llm-awq's packing order differ and are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cadence.quant.formats import Int4Weight
from cadence.quant.int_packing import int4_with_zero_points, unpack_int32
from cadence.quant.tensor_files import TensorFiles, quantized_prefixes

PARTS = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column (within 8) of nibble k
# nibble that holds output column c: the inverse of ORDER
NIBBLE_OF_COLUMN = tuple(sorted(range(8), key=ORDER.__getitem__))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, out / 8] in AWQ's nibble order -> int32 [rows, out] in column order."""
    values = unpack_int32(packed, 4).reshape(packed.shape[0], packed.shape[1], 8)
    return values[:, :, list(NIBBLE_OF_COLUMN)].reshape(packed.shape[0], -1)


class AWQSource:
    """The tensors of an AWQ model folder; `quantization_config` from its config.json."""

    def __init__(self, model_dir: Path, quantization_config: dict[str, Any]) -> None:
        self.model_dir = Path(model_dir)
        qc = quantization_config
        where = f"{self.model_dir}/config.json: quantization_config"
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}.version {version!r} is not supported (gemm)")
        backend = str(qc.get("backend", "autoawq")).lower()
        if backend != "autoawq":
            raise ValueError(f"{where}.backend {backend!r} is not supported (autoawq)")
        if qc.get("bits", 4) != 4:
            raise ValueError(f"{where}.bits {qc.get('bits')!r} is not supported (4)")
        if not qc.get("zero_point", True):
            raise ValueError(f"{where}.zero_point false is not supported (true)")
        self._group_size = int(qc.get("group_size", 128))
        self.files = TensorFiles(self.model_dir)
        self._prefixes = quantized_prefixes(self.files.names())
        groups = "per-channel" if self._group_size == -1 else f"g{self._group_size}"
        self.description = f"awq int4 {groups}"

    def float_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        quantized = {f"{p}.{part}" for p in self._prefixes for part in PARTS}
        yield from self.files.each(n for n in self.files.names() if n not in quantized)

    def quantized_linears(self) -> Iterator[tuple[str, Int4Weight]]:
        for prefix in self._prefixes:
            yield f"{prefix}.weight", self._read(prefix)

    def _read(self, prefix: str) -> Int4Weight:
        for part in PARTS[1:]:
            if f"{prefix}.{part}" not in self.files:
                raise ValueError(f"{self.model_dir}: {prefix}.qweight has no {prefix}.{part}")
        scales = self.files.get(f"{prefix}.scales")  # [groups, out]
        groups, out_features = scales.shape
        q = unpack_awq(self.files.get(f"{prefix}.qweight"))[:, :out_features]  # [in, out]
        zeros = unpack_awq(self.files.get(f"{prefix}.qzeros"))[:, :out_features]
        in_features = q.shape[0]
        expected = 1 if self._group_size == -1 else in_features // self._group_size
        if groups != expected or in_features % groups:
            raise ValueError(
                f"{self.model_dir}: {prefix} has {groups} groups over {in_features} input "
                f"columns, quantization_config.group_size is {self._group_size}"
            )
        return int4_with_zero_points(q.t(), zeros.t(), scales.t())

"""The quantized weight formats every source is converted to.

Every pre-quantized checkpoint (GPTQ, AWQ, a GGUF file) and `--quantize` at load end in
one of these, full-size per checkpoint linear, before a rank takes its slice; the
kernels only ever see these. Both keep the arithmetic of their source exactly (no
re-rounding): a GPTQ/AWQ integer zero point or a GGUF Q4_1 minimum becomes the float
`zero` below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_OFFSET = 8  # int4 values are stored 0..15 and centred on 8 (torch's int4pack convention)


@dataclass(slots=True)
class Int4Weight:
    """`w[o, i] = (q[o, i] - 8) * scale[o, g] + zero[o, g]` with `g = i // group_size`.

    With `perm` set (GPTQ's act-order), the product takes its input columns in that
    order: `y = x[:, perm] @ w.T`; `q`'s columns are already in that order, so groups
    stay contiguous."""

    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, in // group_size]
    zero: torch.Tensor  # float32 [out, in // group_size]
    group_size: int
    perm: torch.Tensor | None = None  # int64 [in]: input column order, None = identity

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] in the checkpoint's column order."""
        groups = (self.q.to(torch.float32) - INT4_OFFSET).reshape(
            self.q.shape[0], -1, self.group_size
        )
        w = (groups * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).reshape(self.q.shape)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def rows(self, start: int, count: int) -> Int4Weight:
        """Output rows [start, start + count)."""
        return Int4Weight(
            self.q[start : start + count],
            self.scale[start : start + count],
            self.zero[start : start + count],
            self.group_size,
            self.perm,
        )

    def cols(self, start: int, count: int) -> Int4Weight:
        """Input columns [start, start + count); both must fall on group boundaries (a
        group is never split across ranks) and the weight must have no `perm`."""
        g = self.group_size
        if start % g or count % g:
            raise ValueError(
                f"input columns [{start}, {start + count}) split a quantization group "
                f"of {g}: choose a tensor-parallel size whose slices hold whole groups"
            )
        if self.perm is not None:
            raise ValueError("an act-order (g_idx) weight cannot be split along its input")
        return Int4Weight(
            self.q[:, start : start + count],
            self.scale[:, start // g : (start + count) // g],
            self.zero[:, start // g : (start + count) // g],
            g,
        )


@dataclass(slots=True)
class Int8Weight:
    """`w[o, i] = q[o, i] * scale[o]`: symmetric, one scale per output channel."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale.unsqueeze(1)).to(dtype)

    def rows(self, start: int, count: int) -> Int8Weight:
        return Int8Weight(self.q[start : start + count], self.scale[start : start + count])

    def cols(self, start: int, count: int) -> Int8Weight:
        return Int8Weight(self.q[:, start : start + count], self.scale)


INT8_BLOCK = 32  # input columns per scale of Int8BlockWeight (GGUF's Q8_0 block)


@dataclass(slots=True)
class Int8BlockWeight:
    """`w[o, i] = q[o, i] * scale[o, i // 32]`: symmetric int8 with a scale per block of 32
    input columns, GGUF's Q8_0 exactly. Served by the CPU integer product where it runs
    (`cadence.quant.cpu_gemm`), elsewhere as its dequantized float weight."""

    q: torch.Tensor  # int8 [out, in], in a multiple of 32
    scale: torch.Tensor  # float32 [out, in // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        blocks = self.q.to(torch.float32).reshape(self.q.shape[0], -1, INT8_BLOCK)
        return (blocks * self.scale.unsqueeze(-1)).reshape(self.q.shape).to(dtype)

    def rows(self, start: int, count: int) -> Int8BlockWeight:
        return Int8BlockWeight(self.q[start : start + count], self.scale[start : start + count])

    def cols(self, start: int, count: int) -> Int8BlockWeight:
        if start % INT8_BLOCK or count % INT8_BLOCK:
            raise ValueError(
                f"input columns [{start}, {start + count}) split an int8 block of "
                f"{INT8_BLOCK}: choose a tensor-parallel size whose slices hold whole blocks"
            )
        b = INT8_BLOCK
        return Int8BlockWeight(
            self.q[:, start : start + count], self.scale[:, start // b : (start + count) // b]
        )


QuantizedWeight = Int4Weight | Int8Weight | Int8BlockWeight

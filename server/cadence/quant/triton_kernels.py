"""Quantized products on a GPU: Triton kernels that dequantize the weight tile by tile
inside the matmul, so only the int8/int4 bytes cross memory.

- int8: `y = (x @ q.T) * scale`, q int8 [out, in], the per-row scale applied once at the
  end of the reduction.
- int4: q packed two per byte along the input (`packed[o, i // 2]`, even i in the low
  nibble), `w = (q - 8) * scale[o, g] + zero[o, g]` per group g, as `Int4Weight`;
  GPTQ's act-order `perm` reorders the input's columns before the kernel.

Each program computes a [BLOCK_M, BLOCK_N] tile of y, reducing over the input in
BLOCK_K steps (int4: BLOCK_K divides the group, so a step reads one scale and zero per
output row). Accumulation is float32. Tested under the Triton interpreter on CPU
(`server/tests/kernels/test_quant_triton.py`), where bfloat16 tiles are upcast before `tl.dot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels import dot_in_f32
from cadence.quant.formats import INT4_OFFSET, Int4Weight, Int8Weight, QuantizedWeight

BLOCK_N = 64
BLOCK_K = 32  # divides every int4 group size cadence serves (32, 64, 128)


def _block_m(rows: int) -> int:
    return max(16, min(64, triton.next_power_of_2(rows)))


@triton.jit
def _int8_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K,
    stride_xm, stride_qn, stride_ym,
    F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :],
            mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0,
        )  # fmt: skip
        q = tl.load(
            q_ptr + rn[None, :] * stride_qn + k[:, None],
            mask=(rn[None, :] < N) & (k[:, None] < K),
            other=0,
        )  # fmt: skip  [BLOCK_K, BLOCK_N]
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), q.to(tl.float32))
        else:
            acc += tl.dot(x, q.to(x.dtype))
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    y = acc * scale[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _int4_matmul_kernel(
    x_ptr, packed_ptr, scale_ptr, zero_ptr, y_ptr, M, N, K,
    stride_xm, stride_pn, stride_sn, stride_ym,
    GROUP: tl.constexpr, OFFSET: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_ok = rn < N
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :],
            mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0,
        )  # fmt: skip
        byte = tl.load(
            packed_ptr + rn[None, :] * stride_pn + (k // 2)[:, None],
            mask=n_ok[None, :] & (k[:, None] < K),
            other=0,
        )  # fmt: skip  [BLOCK_K, BLOCK_N]
        nibble = (byte >> ((k % 2) * 4)[:, None]) & 0xF
        g = k0 // GROUP  # BLOCK_K divides GROUP: one group per step
        scale = tl.load(scale_ptr + rn * stride_sn + g, mask=n_ok, other=0.0)
        zero = tl.load(zero_ptr + rn * stride_sn + g, mask=n_ok, other=0.0)
        w = (nibble.to(tl.float32) - OFFSET) * scale[None, :] + zero[None, :]
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), w)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & n_ok[None, :],
    )


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [out, in] (0..15, `in` even) -> [out, in / 2], even columns low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


class Int8TritonKernel:
    def __init__(self, weight: Int8Weight, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        self.q = weight.q.to(device).contiguous()
        self.scale = weight.scale.to(device=device, dtype=torch.float32).contiguous()
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        m = flat.shape[0]
        y = torch.empty(m, self.out_features, dtype=self.dtype, device=flat.device)
        block_m = _block_m(m)
        grid = (triton.cdiv(m, block_m), triton.cdiv(self.out_features, BLOCK_N))
        if m:
            _int8_matmul_kernel[grid](
                flat, self.q, self.scale, y, m, self.out_features, self.in_features,
                flat.stride(0), self.q.stride(0), y.stride(0),
                F32_DOT=dot_in_f32(self.dtype), BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            )  # fmt: skip
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


class Int4TritonKernel:
    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device) -> None:
        self.out_features, self.in_features = weight.shape
        if weight.group_size % BLOCK_K:
            raise ValueError(f"int4 group {weight.group_size} is not a multiple of {BLOCK_K}")
        self.group_size = weight.group_size
        self.packed = pack_int4(weight.q.to(device))
        self.scale = weight.scale.to(device=device, dtype=torch.float32).contiguous()
        self.zero = weight.zero.to(device=device, dtype=torch.float32).contiguous()
        self.perm = None if weight.perm is None else weight.perm.to(device)
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        flat = flat.contiguous()
        m = flat.shape[0]
        y = torch.empty(m, self.out_features, dtype=self.dtype, device=flat.device)
        block_m = _block_m(m)
        grid = (triton.cdiv(m, block_m), triton.cdiv(self.out_features, BLOCK_N))
        if m:
            _int4_matmul_kernel[grid](
                flat, self.packed, self.scale, self.zero, y, m, self.out_features,
                self.in_features, flat.stride(0), self.packed.stride(0), self.scale.stride(0),
                y.stride(0), GROUP=self.group_size, OFFSET=INT4_OFFSET,
                F32_DOT=dot_in_f32(self.dtype), BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            )  # fmt: skip
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scale.numel() * 4


def kernel_for(
    weight: QuantizedWeight, dtype: torch.dtype, device: torch.device
) -> Int8TritonKernel | Int4TritonKernel:
    if isinstance(weight, Int8Weight):
        return Int8TritonKernel(weight, dtype, device)
    return Int4TritonKernel(weight, dtype, device)

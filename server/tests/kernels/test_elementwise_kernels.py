"""KV write, fused residual + RMSNorm and in-place rotary against their references."""

from __future__ import annotations

import pytest
import torch
from cadence.kernels.kv_write import kv_write, kv_write_ref
from cadence.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from cadence.kernels.rotary import rotary_, rotary_ref
from cadence.layers.rotary import RotaryEmbedding
from kernel_cases import DEVICE, assert_close, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_reference(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    num_blocks, kv_heads, tokens = 40 // block_size + 4, 3, 13
    shape = (num_blocks, block_size, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[5] = -1  # a padding token writes nothing
    slots = slots.to(DEVICE)
    # k is a view into a fused qkv row (non-contiguous), as the model produces it
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, device=DEVICE).to(dtype)
    k = qkv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    k_cache, v_cache = poisoned(shape, dtype), poisoned(shape, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_write(k, v, k_cache, v_cache, slots)
    kv_write_ref(k, v, k_ref, v_ref, slots)
    # written slots equal; every other slot still NaN in both
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)
    assert k_cache.view(-1, kv_heads, head_dim)[slots[slots >= 0]].isfinite().all()


@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    x = torch.randn(7, hidden, device=DEVICE).to(dtype)
    w = torch.randn(hidden, device=DEVICE).to(dtype)
    residual = torch.randn(7, hidden, device=DEVICE).to(dtype) if with_residual else None
    expected = rmsnorm_ref(x, w, 1e-5, residual)
    got = rmsnorm(x, w, 1e-5, residual.clone() if residual is not None else None)
    if with_residual:
        assert_close(got[1], expected[1], dtype)  # the sum, within the dtype's rounding
        # the norm of the sum the kernel wrote: Triton's interpreter may round a bfloat16 sum
        # an ulp away from torch's, which shifts every element of the row's norm
        assert_close(got[0], rmsnorm_ref(got[1], w, 1e-5), dtype)
    else:
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_reference(head_dim: int, dtype: torch.dtype) -> None:
    params = {"rope_theta": 10000.0, "rope_type": "default"}
    rope = RotaryEmbedding(head_dim, params).to(DEVICE)
    positions = torch.tensor([0, 1, 5, 300, 2047, 7], device=DEVICE)
    cos, sin = rope.cos_sin(positions, torch.float32)
    # q as a view into a fused qkv row, rotated in place
    qkv = torch.randn(6, 5 * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, : 4 * head_dim].view(6, 4, head_dim)
    expected = rotary_ref(q.clone(), cos, sin)
    out = rotary_(q, cos, sin)
    assert out.data_ptr() == q.data_ptr()
    assert_close(q, expected, dtype)

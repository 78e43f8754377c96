"""What one element of the KV cache is (`--kv-cache-dtype`), and how keys and values are
quantized into it and read back, in torch (the definition every kernel matches):

- a float dtype (float32, bfloat16, float16): stored as is, no scales;
- `int8`: symmetric, one float32 scale per (token, KV head) stored beside the block
  (`scale = amax / 127` over the head's dimensions, `q = round(x / scale)`), written with
  the token, so no calibration is needed;
- `fp8_e4m3` / `fp8_e5m2` (torch.float8_e4m3fn / float8_e5m2): one float32 scale per
  layer for the keys and one for the values, fixed at warm-up (`cadence.kv_scales`):
  `q = fp8(clamp(x * (1 / scale), -max, max))`, saturating rather than overflowing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.kv_dtypes import KV_CACHE_DTYPES, SCALES

INT8_MAX = 127.0


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # as --kv-cache-dtype spells it
    storage: torch.dtype  # the element dtype of the cache blocks
    scales: str  # "none", "token" (per token and KV head, beside each block), "layer"

    @property
    def quantized(self) -> bool:
        return self.scales != "none"

    @property
    def max(self) -> float:
        """The largest magnitude a stored element represents (before its scale)."""
        if self.storage == torch.int8:
            return INT8_MAX
        return float(torch.finfo(self.storage).max)

    def scale_bytes_per_token_head(self) -> int:
        """Bytes of scale one token's one KV head adds to a block, for keys or values."""
        return 4 if self.scales == "token" else 0


_FORMATS = {
    name: KVFormat(name, storage, SCALES[name])
    for name, storage in (
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("int8", torch.int8),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    )
}


def kv_format(name: str) -> KVFormat:
    """The format `--kv-cache-dtype name` asks for."""
    if name not in _FORMATS:
        raise ValueError(f"KV cache dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return _FORMATS[name]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values, float32 scales [...]): symmetric per row. The
    arithmetic is float32 and in this order (amax / 127 stored; x * (127 / amax) rounded
    half to even) so that the C++ and Triton writes give the same bits."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a true division (Python's `127 / tensor` is a reciprocal times 127: other bits)
    inv = torch.where(amax > 0, torch.full_like(amax, INT8_MAX) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, amax / INT8_MAX


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x scaled by 1 / scale (a float32 scalar tensor), saturated, rounded to `dtype`."""
    top = float(torch.finfo(dtype).max)
    inv = torch.reciprocal(scale.float())
    return (x.float() * inv).clamp_(-top, top).to(dtype)


def quantize(
    x: torch.Tensor, fmt: KVFormat, layer_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New keys or values [T, kv_heads, head_dim] -> (stored elements, per-token scales
    [T, kv_heads] for int8, else None)."""
    if fmt.scales == "token":
        return quantize_int8(x)
    if fmt.scales == "layer":
        assert layer_scale is not None, "an fp8 cache needs its layer's scale"
        return quantize_fp8(x, layer_scale, fmt.storage), None
    return x.to(fmt.storage), None


def dequantize(
    stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Stored elements [..., head_dim] back to `dtype`: times the per-row scale [...] (int8),
    or the layer's scalar scale (fp8); a float cache's elements are only converted."""
    if scale is None:
        return stored.to(dtype)
    s = scale.unsqueeze(-1) if scale.dim() == stored.dim() - 1 else scale
    return (stored.float() * s).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (torch's index_copy_ has no float8 kernel); any
    other tensor as is."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t

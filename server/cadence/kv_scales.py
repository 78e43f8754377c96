"""The per-layer scales of an fp8 KV cache: read from a calibration file
(`--kv-cache-scales`), or estimated at warm-up from the keys and values a forward wrote
into a float cache.

The file: `{"k_scale": [s_0, ..., s_{L-1}], "v_scale": [...]}`, one positive float per
layer (a layer stores `value / scale`). The estimate: the largest |key| (|value|) the
warm-up forward wrote in each layer, times HEADROOM, maps to the fp8 format's largest
value. fp8's precision is relative, so headroom costs nothing but range at the
subnormal end, while a value past the scaled range would saturate: the headroom covers
texts whose keys and values run larger than the warm-up prompt's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HEADROOM = 4.0
# Tokens of the warm-up prompt whose keys and values the estimate reads: enough for the
# attention sinks and the outlier channels to show, short enough to cost nothing.
CALIBRATION_TOKENS = 256


def read_scales_file(path: str | Path, num_layers: int | None) -> torch.Tensor:
    """[layers, 2] float32 (keys, values) from a scales file; `num_layers`, when given,
    must be its length."""
    try:
        data = json.loads(Path(path).read_text())
        k, v = data["k_scale"], data["v_scale"]
        scales = torch.tensor([k, v], dtype=torch.float32).T.contiguous()
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"--kv-cache-scales {path}: expected a JSON file "
            f'{{"k_scale": [one float per layer], "v_scale": [...]}} ({err})'
        ) from None
    if scales.dim() != 2 or not bool((scales > 0).all()) or not scales.isfinite().all():
        raise ValueError(f"--kv-cache-scales {path}: every scale must be a positive number")
    if num_layers is not None and scales.shape[0] != num_layers:
        raise ValueError(
            f"--kv-cache-scales {path} holds {scales.shape[0]} layers' scales; the model "
            f"has {num_layers} attention layers"
        )
    return scales


def write_scales_file(path: str | Path, scales: torch.Tensor) -> None:
    """Saves [layers, 2] scales in the form read_scales_file reads."""
    k, v = scales.T.tolist()
    Path(path).write_text(json.dumps({"k_scale": k, "v_scale": v}, indent=1) + "\n")


def estimate_scales(
    blocks: torch.Tensor, used_blocks: int, fp8_max: float, headroom: float = HEADROOM
) -> torch.Tensor:
    """[layers, 2] scales from a float cache `blocks` [layers, 2, blocks, ...] whose first
    `used_blocks` blocks hold what the warm-up forward wrote (the rest are zeros)."""
    amax = blocks[:, :, :used_blocks].abs().float().amax(dim=(2, 3, 4, 5))
    # a layer whose keys were all 0 still needs a positive scale
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    return (amax * headroom / fp8_max).to(torch.float32).cpu()

"""The names `--kv-cache-dtype` takes and what each stores beside its elements, free of
torch: the command line and the launcher check a choice before any shard starts, and
neither imports torch (`cadence.kv_format` is the torch side: storage dtypes and the
arithmetic)."""

from __future__ import annotations

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = (*FLOAT_DTYPES, *QUANTIZED)

# The scales beside the elements: none; one per (token, KV head), written with the token;
# one per layer for keys and one for values, fixed at warm-up or read from a file.
SCALES = {
    "float32": "none",
    "bfloat16": "none",
    "float16": "none",
    "int8": "token",
    "fp8_e4m3": "layer",
    "fp8_e5m2": "layer",
}


def check_kv_cache_choice(kv_cache_dtype: str, scales_path: str) -> None:
    """Raises ValueError, saying what to change, for a KV cache dtype cadence lacks, a
    scales file beside a cache that takes none, or a file that does not parse."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if not scales_path:
        return
    if SCALES[kv_cache_dtype] != "layer":
        raise ValueError(
            f"--kv-cache-scales is for an fp8 KV cache (fp8_e4m3, fp8_e5m2), not "
            f"--kv-cache-dtype {kv_cache_dtype}: int8 computes a scale per token as it "
            f"writes it, a float cache takes none"
        )
    from cadence.kv_scales import read_scales_file  # torch: only when a file is given

    read_scales_file(scales_path, num_layers=None)

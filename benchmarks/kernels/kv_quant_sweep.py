"""What a KV cache narrower than int8 would cost in accuracy, before any kernel is written:
transformers' Llama on the embedded SmolLM2-135M (float32, from the GGUF) over the same
text as kv_cache_accuracy.py, every layer's keys and values rounded (after the rotary
embedding, as the cache stores them) to each format below, against the unrounded model:
top-1 agreement, perplexity, and the largest |logit difference|. Every position attends
through rounded keys and values, its own included, as a decode step over the cache does.

    PYTHONPATH=server python benchmarks/kernels/kv_quant_sweep.py

A format is (key bits, value bits, group size, asymmetric): symmetric formats keep one
scale per group of `group` elements of a token's head (amax / (2^(bits-1) - 1)),
asymmetric ones a scale and a minimum ((max - min) / (2^bits - 1)).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from cadence.model_source import resolve_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import modeling_llama

FORMATS: dict[str, tuple[int | None, int | None, int, bool]] = {
    "int8 (the cache's)": (8, 8, 64, False),
    "int6": (6, 6, 64, False),
    "int4": (4, 4, 64, False),
    "int4, groups of 32": (4, 4, 32, False),
    "int4, groups of 16": (4, 4, 16, False),
    "int4 asymmetric": (4, 4, 64, True),
    "int4 asymmetric, groups of 32": (4, 4, 32, True),
    "keys int8, values int4": (8, 4, 64, False),
    "keys int8, values int4, both asymmetric in groups of 32": (8, 4, 32, True),
    "keys int4, values int8": (4, 8, 64, False),
}


def rounded(x: torch.Tensor, bits: int | None, group: int, asymmetric: bool) -> torch.Tensor:
    """`x` [..., head_dim] as the format stores it, read back."""
    if bits is None:
        return x
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if asymmetric:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        levels = (1 << bits) - 1
        scale = ((hi - lo) / levels).clamp_min(1e-8)
        out = torch.round((g - lo) / scale).clamp(0, levels) * scale + lo
    else:
        top = (1 << (bits - 1)) - 1
        scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-8) / top
        out = torch.round(g / scale).clamp(-top, top) * scale
    return out.reshape(x.shape)


def main() -> None:
    spec = importlib.util.spec_from_file_location(
        "kv_cache_accuracy", Path(__file__).with_name("kv_cache_accuracy.py")
    )
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    model_dir = resolve_model(None)
    ids = AutoTokenizer.from_pretrained(model_dir)(source.TEXT, return_tensors="pt")["input_ids"]
    ids = ids[:, :320]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file="weights.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    attention = modeling_llama.eager_attention_forward
    current: list[tuple[int | None, int | None, int, bool]] = [(None, None, 64, False)]

    def rounding_attention(module: Any, query: Any, key: Any, value: Any, *a: Any, **k: Any) -> Any:
        key_bits, value_bits, group, asymmetric = current[0]
        key = rounded(key, key_bits, group, asymmetric)
        value = rounded(value, value_bits, group, asymmetric)
        return attention(module, query, key, value, *a, **k)

    modeling_llama.eager_attention_forward = rounding_attention

    def logits(fmt: tuple[int | None, int | None, int, bool]) -> torch.Tensor:
        current[0] = fmt
        with torch.no_grad():
            return model(ids).logits[0, :-1].float()

    target = ids[0, 1:]

    def perplexity(x: torch.Tensor) -> float:
        return float(torch.exp(torch.nn.functional.cross_entropy(x, target)))

    ref = logits((None, None, 64, False))
    print(f"SmolLM2-135M float32, {ref.shape[0]} positions, perplexity {perplexity(ref):.3f}")
    print("| KV format | top-1 agreement | perplexity | max |dlogit| |")
    print("| --- | --- | --- | --- |")
    for name, fmt in FORMATS.items():
        got = logits(fmt)
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        print(
            f"| {name} | {100 * top1:.1f}% | {perplexity(got):.3f} | "
            f"{float((got - ref).abs().max()):.2f} |"
        )


if __name__ == "__main__":
    main()

r"""What integer activations would cost in accuracy: the embedded SmolLM2-135M's float32
copy with every linear's input (the LM head's aside) rounded as an integer product would
see it, and its weights float or int8 per output channel: perplexity on the bench corpus's
first 1,024 tokens (teacher-forced, 256 at a time) and agreement of the greedy next token
with the float32 model. The rounding is done in float32 (quantize, dequantize), so this
measures the formats, not a kernel.

Activation formats: `bf16` (the float copy's products), `int8` (one scale per row: what
the AMX-INT8 tiles need to sum a whole row in int32), `int8-g32` / `int8-g64` (one scale
per block of 32 / 64 inputs: the integer product's blocks), `int16` (one scale per row).

    PYTHONPATH=server python benchmarks/kernels/activation_accuracy.py \
        --model "$(cadence convert --dtype float32 | tail -n 1)" [--variants float:int8,...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from cadence.quant.quantize import quantize_int8
from transformers import AutoModelForCausalLM, AutoTokenizer

CORPUS = Path(__file__).resolve().parents[2] / "server/cadence_bench/corpus.txt"
DEFAULT_VARIANTS = (
    "float:bf16,float:int16,float:int8,int8:bf16,int8:int16,int8:int8-g32,int8:int8-g64,int8:int8"
)
TOKENS, CHUNK = 1024, 256


def rounding(fmt: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """x as the activation format `fmt` holds it, back in float32."""
    if fmt == "bf16":
        return lambda x: x.to(torch.bfloat16).float()
    bits = 16 if fmt == "int16" else 8
    top = 2 ** (bits - 1) - 1
    group = int(fmt.split("-g")[1]) if "-g" in fmt else 0

    def symmetric(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        blocks = x.reshape(*shape[:-1], shape[-1] // group, group) if group else x
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
        return ((blocks / scale).round().clamp(-top, top) * scale).reshape(shape)

    return symmetric


def evaluate(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Perplexity of ids[1:] and the logits of every position but the last."""
    with torch.no_grad():
        parts = [
            model(ids[:, : s + CHUNK]).logits[0, s : s + CHUNK] for s in range(0, TOKENS, CHUNK)
        ]
    logits = torch.cat(parts)[:-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp()), logits


def variant(model: torch.nn.Module, weights: str, activations: str) -> torch.nn.Module:
    round_input = rounding(activations)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or name == "lm_head":
                continue
            if weights == "int8":
                module.weight.copy_(quantize_int8(module.weight).dequantize(torch.float32))
            module.register_forward_pre_hook(lambda _m, args: (round_input(args[0]),))
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="the float32 copy (cadence convert)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="weights:activations, ...")
    a = p.parse_args()
    text = CORPUS.read_text()
    ids = AutoTokenizer.from_pretrained(a.model)(text, return_tensors="pt")["input_ids"]
    ids = ids[:, :TOKENS]

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()

    ppl, ref = evaluate(load(), ids)
    print(f"{ids.shape[1]} tokens; float32: perplexity {ppl:.3f}")
    print("| weights | activations | perplexity | top-1 agreement | max |Δ logit| |")
    print("| --- | --- | --- | --- | --- |")
    for spec in a.variants.split(","):
        weights, activations = spec.split(":")
        q_ppl, logits = evaluate(variant(load(), weights, activations), ids)
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        worst = float((logits - ref).abs().max())
        print(
            f"| {weights} | {activations} | {q_ppl:.3f} ({(q_ppl / ppl - 1) * 100:+.2f}%) "
            f"| {agree:.4f} | {worst:.3f} |"
        )


if __name__ == "__main__":
    main()

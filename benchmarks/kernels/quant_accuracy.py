r"""What each quantization costs in accuracy on a real model: perplexity on the bench
corpus and agreement of the greedy next token with the float model, for int8 and int4
(groups 32/64/128), with the LM head kept float, quantized alike, or in int8.

The weights are quantized with cadence's quantizers and dequantized back into a
transformers model (the kernels compute exactly that product: server/tests/
test_quant_model.py), so this measures the formats, not the kernels.

    python benchmarks/kernels/quant_accuracy.py \
        [--model ~/.cache/cadence/models/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from cadence.model_source import default_model_dir
from cadence.quant.quantize import group_size_for, quantize_int4, quantize_int8
from transformers import AutoModelForCausalLM, AutoTokenizer

CORPUS = Path(__file__).resolve().parents[2] / "server/cadence_bench/corpus.txt"
VARIANTS = [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)]
# The embedded SmolLM2 comes from a GGUF file whose linears are 4-bit in blocks of 32: int4
# g32 reproduces them exactly, and only the head (8-bit there) shows what int4 costs.


def quantized_copy(model: torch.nn.Module, fmt: str, group: int, head: str) -> None:
    """Replaces every linear weight by its dequantized value; the LM head's as `head`
    says: "float" (left), "same" (as the others), "int8"."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            this = fmt
            if name == "lm_head":
                if head == "float":
                    continue
                this = "int8" if head == "int8" else fmt
                # tied to the embedding: the head gets its own weight
                module.weight = torch.nn.Parameter(module.weight.detach().clone())
            w = module.weight
            if this == "int8":
                q = quantize_int8(w)
            else:
                q = quantize_int4(w, group_size_for(w.shape[1], group))
            w.copy_(q.dequantize(w.dtype))


def evaluate(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return float(nll.exp()), logits.argmax(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(default_model_dir()))
    a = p.parse_args()
    torch.manual_seed(0)
    ids = AutoTokenizer.from_pretrained(a.model)(CORPUS.read_text(), return_tensors="pt")[
        "input_ids"
    ]
    load = lambda: AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()  # noqa: E731
    ppl, greedy = evaluate(load(), ids)
    print(f"{ids.shape[1]} tokens; float32: perplexity {ppl:.3f}")
    for fmt, group in VARIANTS:
        for head in ("float", "same", "int8") if fmt == "int4" else ("float", "same"):
            model = load()
            quantized_copy(model, fmt, group, head)
            q_ppl, q_greedy = evaluate(model, ids)
            same = float((q_greedy == greedy).float().mean())
            name = fmt if fmt == "int8" else f"{fmt} g{group}"
            print(
                f"{name:>9}, head {head:>5}: perplexity "
                f"{q_ppl:.3f} ({(q_ppl / ppl - 1) * 100:+.2f}%), greedy token agrees {same:.1%}"
            )


if __name__ == "__main__":
    main()

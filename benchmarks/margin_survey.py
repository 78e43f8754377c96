"""The margin rule's two numbers (integration-tests/margin.py) for `cadence launch` with
each KV cache dtype given, over more prompts and tokens than the tests judge: the largest
logprob error, the largest choice gap and how many greedy tokens were not the float32
reference's top one. What docs/quantization.md's bound for a KV cache is measured with.

    PYTHONPATH=server python benchmarks/margin_survey.py bfloat16 int8 [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration-tests"))

import httpx  # noqa: E402
import torch  # noqa: E402
from margin import judge, served_greedy  # noqa: E402

from conftest import CHAT_PROMPTS, launch, smollm_float_copy, stop  # noqa: E402

MORE_PROMPTS = [
    "Tell me a story about a dragon.",
    "What causes rain?",
    "Name five fruits.",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
    "What is photosynthesis?",
    "Give three tips for studying.",
    "Who wrote Hamlet?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kv_cache_dtypes", nargs="+")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--work-dir", default="/tmp/margin-survey")
    args = parser.parse_args()

    from cadence.convert import convert_gguf
    from cadence.model_source import resolve_model
    from cadence.quant.checkpoints import GGUF_WEIGHTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    float_dir = convert_gguf(Path(resolve_model(None)) / GGUF_WEIGHTS, smollm_float_copy())
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for kv in args.kv_cache_dtypes:
        server = launch(work, "--kv-cache-memory", "128MiB", "--kv-cache-dtype", kv)
        error = gap = 0.0
        off_top = total = 0
        with httpx.Client(base_url=server.url, timeout=300) as client:
            for prompt in CHAT_PROMPTS + MORE_PROMPTS:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                judgement = judge(model, *served_greedy(client, text, args.tokens))
                error = max(error, judgement.logprob_error)
                gap = max(gap, judgement.choice_gap)
                off_top += judgement.near_ties
                total += args.tokens
        stop(server)
        print(
            f"{kv}: largest logprob error {error:.3f}, largest choice gap {gap:.3f}, "
            f"{off_top} of {total} tokens not the reference's top"
        )


if __name__ == "__main__":
    main()

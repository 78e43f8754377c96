"""The margin rule: how a server whose arithmetic differs from the reference's (bfloat16,
int8 activations, another summation order) is held to the reference without asserting a
text that sits on a knife's edge.

The reference (transformers in float32 on the very weights the server holds) is run
teacher-forced over the server's own tokens, so every position is judged on the context
the server actually had. Two things must hold at each generated position:

- the logprob the server reports for its token is within `bound` of the reference's
  logprob for that token (the server's numbers are the reference's, up to its rounding);
- the token the server chose is within `bound` of the reference's best there:
  `ref[best] - ref[chosen] < bound`. Where the reference's top-2 margin exceeds the bound
  only its top token qualifies; inside a near-tie either side may win, as it would on
  another CPU (or in llama.cpp on the same file).

A broken kernel moves logprobs by whole nats and picks tokens far down the reference's
list; both checks fail then. The bounds are measured, per kind of arithmetic, below.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import torch

# Quantized serving (int8-quantized activations in blocks of 32 through the integer
# product, bfloat16 or float32 compute, a bfloat16 KV cache or the int8 one it takes where
# that is measured faster): the embedded Q4_1 file served as it is measured at most 0.34
# nat of logprob error and 0.14 of choice gap natively on an AVX-512 BF16 Zen 4, 0.36 and
# 0.17 held to AVX2; over 16 prompts x 64 tokens 0.59 / 0.27 with a bfloat16 cache and
# 0.32 / 0.40 with int8; --quantize int4 up to 0.75 over 32 tokens (docs/quantization.md,
# "the margin rule").
QUANTIZED_BOUND = 1.0


@dataclass(frozen=True, slots=True)
class Judgement:
    """The worst of each check over the positions judged, for the assertion messages."""

    logprob_error: float  # max |served logprob - reference logprob| of the chosen tokens
    choice_gap: float  # max reference logprob of its best token minus that of the chosen one
    near_ties: int  # positions where the server chose another token than the reference's top

    def holds(self, bound: float) -> bool:
        return self.logprob_error < bound and self.choice_gap < bound


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(token | the tokens before it) under `model` for every position after the first:
    [len(ids) - 1, vocab], float32, one teacher-forced forward pass."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def judge(
    model: torch.nn.Module,
    prompt_ids: list[int],
    generated_ids: list[int],
    served_logprobs: list[float],
) -> Judgement:
    """The server's greedy continuation `generated_ids` of `prompt_ids` (with the logprob
    it reported for each) judged against `model` teacher-forced on it."""
    assert generated_ids, "nothing was generated"
    assert len(served_logprobs) == len(generated_ids)
    expected = reference_logprobs(model, prompt_ids + generated_ids)[len(prompt_ids) - 1 :]
    chosen = expected.gather(1, torch.tensor(generated_ids)[:, None])[:, 0]
    best = expected.max(dim=-1)
    error = (torch.tensor(served_logprobs) - chosen).abs().max()
    gap = (best.values - chosen).max()
    ties = int((best.indices != torch.tensor(generated_ids)).sum())
    return Judgement(float(error), float(gap), ties)


def served_greedy(
    client: httpx.Client, text: str, max_new_tokens: int
) -> tuple[list[int], list[int], list[float]]:
    """A server's greedy continuation of `text` through TGI's /generate: the prompt's token
    ids (as the server tokenized it), the generated ids and the logprob it gave each."""
    parameters = {"max_new_tokens": max_new_tokens, "details": True, "decoder_input_details": True}
    response = client.post("/generate", json={"inputs": text, "parameters": parameters})
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    generated = details["tokens"]
    prompt_ids = [token["id"] for token in details["prefill"]]
    return prompt_ids, [t["id"] for t in generated], [t["logprob"] for t in generated]

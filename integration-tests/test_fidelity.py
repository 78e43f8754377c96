"""cadence's greedy output is token for token what transformers generates on the same weights."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a short motivational quote.",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 64


def greedy_ids(client: httpx.Client, text: str, max_new_tokens: int) -> list[int]:
    response = client.post(
        "/generate",
        json={"inputs": text, "parameters": {"max_new_tokens": max_new_tokens, "details": True}},
    )
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


@pytest.fixture(scope="module")
def transformers_reference(smollm_dir: str) -> tuple[list[str], list[list[int]], int]:
    """Chat prompts rendered with the model's template, and transformers' greedy continuations."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    texts, outputs = [], []
    for prompt in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        input_ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            generated = model.generate(
                input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1
            )
        texts.append(text)
        outputs.append(generated[0, input_ids.shape[1] :].tolist())
    return texts, outputs, tokenizer.eos_token_id


def test_greedy_chat_output_equals_transformers(
    client: httpx.Client, transformers_reference: tuple[list[str], list[list[int]], int]
) -> None:
    texts, expected, eos_id = transformers_reference
    for text, reference in zip(texts, expected, strict=True):
        ours = greedy_ids(client, text, NEW_TOKENS)
        # Both stop after the EOS token; TGI's details list it (special, no text), as cadence does.
        reference = reference[: reference.index(eos_id) + 1] if eos_id in reference else reference
        assert ours == reference, text


def test_32_concurrent_requests_each_equal_their_output_alone(client: httpx.Client) -> None:
    prompts = [
        f"Request {i}: "
        + " ".join(["tell me about", "the history of", "numbers like"][: 1 + i % 3])
        + f" {i * 7}" * (1 + i % 5)
        for i in range(32)
    ]
    lengths = [8 + (i * 5) % 40 for i in range(32)]
    alone = [greedy_ids(client, p, n) for p, n in zip(prompts, lengths, strict=True)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(
            pool.map(lambda pn: greedy_ids(client, *pn), zip(prompts, lengths, strict=True))
        )
    for prompt, one, batched in zip(prompts, alone, together, strict=True):
        assert batched == one, prompt

"""cadence's greedy output is token for token what transformers generates on the same weights."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import NEW_TOKENS, greedy_ids, reference_up_to_eos


def test_greedy_chat_output_equals_transformers(
    client: httpx.Client, transformers_reference: tuple[list[str], list[list[int]], int]
) -> None:
    texts, expected, eos_id = transformers_reference
    for text, reference in zip(texts, expected, strict=True):
        ours = greedy_ids(client, text, NEW_TOKENS)
        # Both stop after the EOS token; TGI's details list it (special, no text), as cadence does.
        assert ours == reference_up_to_eos(reference, eos_id), text


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

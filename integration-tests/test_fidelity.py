"""cadence's greedy output is token for token what transformers generates on the same weights."""

from __future__ import annotations

import httpx

from conftest import NEW_TOKENS, greedy_ids_together, reference_up_to_eos


def test_greedy_chat_output_equals_transformers(
    client: httpx.Client, transformers_reference: tuple[list[str], list[list[int]], int]
) -> None:
    texts, expected, eos_id = transformers_reference
    for text, ours, reference in zip(
        texts, greedy_ids_together(client, texts, NEW_TOKENS), expected, strict=True
    ):
        # Both stop after the EOS token; TGI's details list it (special, no text), as cadence does.
        assert ours == reference_up_to_eos(reference, eos_id), text

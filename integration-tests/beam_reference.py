"""Beam search checked against transformers' `generate(num_beams=...)` in float32: the
beams in order, their tokens, and their scores (cumulative logprob / length) within
float32 rounding, for chat prompts through TGI's `/generate`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest

WIDTH, NEW_TOKENS = 3, 16


def assert_beams_as_transformers(
    url: str, tokenizer: Any, model: Any, prompts: Sequence[str]
) -> int:
    """Each prompt's WIDTH beams from the server at `url` are transformers' (a beam that
    ended at EOS is a prefix of its reference, padded after); how many ended so."""
    import torch

    ended = 0
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        input_ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            want = model.generate(
                input_ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                num_beams=WIDTH,
                num_return_sequences=WIDTH,
                length_penalty=1.0,
                early_stopping=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        body = {
            "inputs": text,
            "parameters": {"num_beams": WIDTH, "max_new_tokens": NEW_TOKENS, "details": True},
        }
        answer = httpx.post(f"{url}/generate", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        details = answer.json()["details"]
        beams = [details, *details["best_of_sequences"]]
        assert len(beams) == WIDTH, (prompt, len(beams))
        for i, beam in enumerate(beams):
            ids = [t["id"] for t in beam["tokens"]]
            expected = want.sequences[i, input_ids.shape[1] :].tolist()
            assert ids == expected[: len(ids)], (prompt, i)
            assert all(t == tokenizer.pad_token_id for t in expected[len(ids) :]), (prompt, i)
            score = sum(t["logprob"] for t in beam["tokens"]) / len(ids)
            assert score == pytest.approx(want.sequences_scores[i].item(), abs=2e-3), (prompt, i)
            ended += len(ids) < NEW_TOKENS
    return ended

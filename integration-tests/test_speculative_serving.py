"""Speculative decoding through `cadence launch`: with n-gram proposals and with a draft
model (the target's own weights; a random tiny model of the same vocabulary), greedy
output is transformers' token for token, seeded sampling with penalties answers as the
server without speculation does, proposals are really made and accepted (/metrics), and
an OpenAI client's stream carries every token of the multi-token steps."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from invariance import PROMPTS, ask, asked, differences, probe, served_model

from conftest import (
    NEW_TOKENS,
    SMOLLM_FLOAT32,
    LaunchedServer,
    greedy_ids,
    greedy_ids_together,
    launch,
    metrics,
    reference_up_to_eos,
    stop,
    tiny_model,
    together,
)

# The load switch must not interfere: one request at a time, up to 4 proposals.
SPECULATIVE = ("--num-speculative-tokens", "4", "--speculative-max-step-tokens", "64")
TINY_BLOCKS = 256
# A passage the model is asked to copy: where prompt lookup finds its proposals.
PASSAGE = (
    "The old lighthouse stood at the edge of the harbour for two hundred years. Every night "
    "its keeper climbed the hundred and twelve steps, trimmed the wick and wound the clock "
    "that turned the great lens, and every morning he wrote the weather in a leather book."
)


def spec_counts(url: str) -> tuple[float, float, float]:
    """(verifications, proposed tokens, accepted tokens) so far."""
    m = metrics(url)

    def total(name: str) -> float:
        return sum(v for k, v in m.items() if k.startswith(f"vllm:spec_decode_num_{name}_total{{"))

    return total("drafts"), total("draft_tokens"), total("accepted_tokens")


def copy_prompt(tokenizer: Any) -> str:
    message = {"role": "user", "content": f"Repeat the following text exactly:\n\n{PASSAGE}"}
    return tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)


def transformers_greedy(tokenizer: Any, model: Any, text: str, new_tokens: int) -> list[int]:
    import torch

    input_ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False, num_beams=1)
    ids = out[0, input_ids.shape[1] :].tolist()
    return reference_up_to_eos(ids, tokenizer.eos_token_id)


def assert_greedy_equals_transformers(
    server: LaunchedServer, reference: tuple[list[str], list[list[int]], int]
) -> None:
    texts, expected, eos_id = reference
    with httpx.Client(base_url=server.url, timeout=300) as client:
        ours = greedy_ids_together(client, texts[:4], NEW_TOKENS)
    for text, got, want in zip(texts[:4], ours, expected[:4], strict=True):
        assert got == reference_up_to_eos(want, eos_id), text


@pytest.fixture(scope="module")
def ngram_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    tmp = tmp_path_factory.mktemp("spec-ngram")
    server = launch(
        tmp,
        *SMOLLM_FLOAT32,
        "--speculative",
        "ngram",
        *SPECULATIVE,
        "--served-model-name",
        "smollm",
    )
    yield server
    assert stop(server) == 0, server.log()


def test_ngram_greedy_output_is_transformers_and_proposals_are_accepted(
    ngram_server: LaunchedServer,
    transformers_reference: tuple[list[str], list[list[int]], int],
    float_reference: tuple[Any, Any],
) -> None:
    info = httpx.get(f"{ngram_server.url}/info").json()["speculative"]
    assert info["method"] == "ngram" and info["max_step_tokens"] == "64", info
    assert_greedy_equals_transformers(ngram_server, transformers_reference)
    before = spec_counts(ngram_server.url)
    text = copy_prompt(float_reference[0])
    with httpx.Client(base_url=ngram_server.url, timeout=300) as client:
        ours = greedy_ids(client, text, 64)
    assert ours == transformers_greedy(*float_reference, text, 64)
    drafts, proposed, accepted = (
        a - b for a, b in zip(spec_counts(ngram_server.url), before, strict=True)
    )
    # Copying a passage: most proposals are the passage's next tokens.
    assert drafts > 0 and accepted > proposed / 2, (drafts, proposed, accepted)
    assert accepted > 20, "fewer steps than tokens"


def test_an_openai_stream_carries_every_token_of_the_accepted_runs(
    ngram_server: LaunchedServer, smollm_server: LaunchedServer
) -> None:
    def stream(url: str) -> list[str]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        chunks = client.chat.completions.create(
            model="smollm",
            messages=[{"role": "user", "content": f"Repeat exactly:\n\n{PASSAGE}"}],
            max_tokens=60,
            temperature=0,
            stream=True,
        )
        return [c.choices[0].delta.content or "" for c in chunks if c.choices]

    with_spec, without = stream(ngram_server.url), stream(smollm_server.url)
    assert "".join(with_spec) == "".join(without)
    assert "lighthouse" in "".join(with_spec)


def test_seeded_sampling_with_penalties_answers_as_without_speculation(
    ngram_server: LaunchedServer, smollm_server: LaunchedServer
) -> None:
    body = {
        "inputs": f"Repeat exactly: {PASSAGE}\n",
        "parameters": {
            "max_new_tokens": 48,
            "do_sample": True,
            "seed": 11,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "repetition_penalty": 1.1,
            "frequency_penalty": 0.2,
            "details": True,
            "decoder_input_details": False,
        },
    }

    def answer(url: str) -> tuple[str, list[int]]:
        v = httpx.post(f"{url}/generate", json=body, timeout=300).json()
        return v["generated_text"], [t["id"] for t in v["details"]["tokens"]]

    before = spec_counts(ngram_server.url)
    assert answer(ngram_server.url) == answer(smollm_server.url)
    assert spec_counts(ngram_server.url)[0] > before[0], "no step carried proposals"


def random_draft(folder: Path, like: str) -> Path:
    """A random two-layer Llama with the served model's vocabulary and tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((Path(like) / "config.json").read_text())
    torch.manual_seed(0)
    tiny = LlamaConfig(
        vocab_size=config["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=config["max_position_embeddings"],
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
    )  # fmt: skip
    LlamaForCausalLM(tiny).save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(like) / name, folder / name)
    return folder


@pytest.mark.parametrize("draft", ["same-weights", "random"])
def test_a_draft_model_changes_the_steps_not_the_greedy_output(
    draft: str,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_reference: tuple[list[str], list[list[int]], int],
    tiny_llama_dir: str,
) -> None:
    """The tiny random Llama as the target (the draft path is the point, not the model):
    drafted by itself, or by a random model of its vocabulary."""
    tmp = tmp_path_factory.mktemp(f"spec-draft-{draft}")
    folder = (
        tiny_llama_dir if draft == "same-weights" else str(random_draft(tmp / "m", tiny_llama_dir))
    )
    server = launch(
        tmp,
        *tiny_model(tiny_llama_dir, TINY_BLOCKS),
        *("--speculative", "draft", "--draft-model-id", folder, *SPECULATIVE),
    )
    try:
        assert httpx.get(f"{server.url}/info").json()["speculative"]["draft_model"]
        assert_greedy_equals_transformers(server, tiny_reference)
        drafts, proposed, accepted = spec_counts(server.url)
        assert drafts > 0
        if draft == "same-weights":
            # The target proposing to itself: every proposal is its own greedy token.
            assert accepted == proposed, (proposed, accepted)
        else:
            assert accepted < proposed / 4, (proposed, accepted)
    finally:
        assert stop(server) == 0, server.log()


def test_speculation_changes_no_bit_of_an_answer(
    ngram_server: LaunchedServer, smollm_server: LaunchedServer
) -> None:
    """With n-gram proposals verified several tokens per row, every answer (greedy and
    seeded) is the server's without speculation bit for bit -- alone, in a crowd and again."""
    prompts = (f"Repeat the following text exactly:\n\n{PASSAGE}", *PROMPTS[:3])
    asks = asked(prompts, seeded=2)
    model = served_model(smollm_server.url)
    # sent together: the server without speculation is batch-invariant (test_determinism)
    without = together(*(lambda p=p, s=s: ask(smollm_server.url, model, p, 24, s) for p, s in asks))
    _, _, accepted_before = spec_counts(ngram_server.url)
    situations = probe(ngram_server.url, prompts, seeded=2, max_tokens=24, crowd=8)
    assert spec_counts(ngram_server.url)[2] > accepted_before, "proposals were accepted"
    situations["without speculation"] = without
    found = differences(situations, asks)
    assert not found, "\n".join(found)

"""`cadence launch --num-shard 2`: two shard processes in a gloo group serve SmolLM2
with the same greedy tokens as one shard, every step checked rank against rank; an OPT
checkpoint is served end to end and generates what transformers generates."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from invariance import PROMPTS, assert_same_answers

from conftest import (
    CHAT_PROMPTS,
    FLOAT32,
    SMOLLM_FLOAT32,
    LaunchedServer,
    greedy_ids,
    greedy_ids_together,
    launch,
    reference_up_to_eos,
    stop,
)

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    """SmolLM2 in float32 over 2 ranks (its 9 heads / 3 KV heads split unevenly)."""
    tmp = tmp_path_factory.mktemp("smollm-tp2")
    server = launch(
        tmp,
        *("--num-shard", "2", *SMOLLM_FLOAT32, "--kv-cache-memory", "256MiB"),
        "--check-rank-agreement",
    )
    yield server
    code = stop(server)
    assert code == 0, f"launcher exited with {code} on SIGTERM:\n{server.log()}"


def test_two_shards_generate_the_same_greedy_tokens_as_one(
    two_shards: LaunchedServer, client: httpx.Client
) -> None:
    prompts = CHAT_PROMPTS[:4]
    with httpx.Client(base_url=two_shards.url, timeout=300) as tp:
        info = tp.get("/info").json()
        ones = greedy_ids_together(client, prompts, NEW_TOKENS)
        twos = greedy_ids_together(tp, prompts, NEW_TOKENS)
    for prompt, one, two in zip(prompts, ones, twos, strict=True):
        assert two == one, prompt
    assert info["world_size"] == 2
    log = two_shards.log()
    assert "rank 1/2" in log and "disagrees" not in log


def test_two_shards_answer_alike_alone_in_a_crowd_and_again(two_shards: LaunchedServer) -> None:
    """Batch invariance across ranks: each all-reduce adds the two parts in one order."""
    assert_same_answers(two_shards.url, PROMPTS[:4], seeded=2, max_tokens=10, crowd=12)


def test_two_shards_give_the_same_constrained_greedy_tokens_as_one(
    two_shards: LaunchedServer, client: httpx.Client
) -> None:
    """The router computes each mask once and every rank applies the same one."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 30}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
    }
    grammars = [
        {"type": "json", "value": schema},
        {"type": "regex", "value": "[A-Z][a-z]+ [0-9]{2}"},
    ]
    cases = [(prompt, grammar) for prompt in CHAT_PROMPTS[:3] for grammar in grammars]
    texts, case_grammars = [c[0] for c in cases], [c[1] for c in cases]
    # each server decodes the six requests in one batch (both are batch-invariant)
    with httpx.Client(base_url=two_shards.url, timeout=300) as tp:
        ones = greedy_ids_together(client, texts, 48, case_grammars)
        twos = greedy_ids_together(tp, texts, 48, case_grammars)
    for case, one, two in zip(cases, ones, twos, strict=True):
        assert one == two, case
    assert "disagrees" not in two_shards.log()


def test_two_shards_search_beams_as_transformers_does(
    two_shards: LaunchedServer, float_reference: tuple[object, object]
) -> None:
    """Beam search over 2 ranks: the beams and scores of transformers' float32 search on
    the embedded model's weights (chat prompts, so a beam may end at EOS)."""
    import torch

    tokenizer, model = float_reference
    for prompt in CHAT_PROMPTS[:2]:
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        input_ids = tokenizer(text, return_tensors="pt").input_ids  # type: ignore[operator]
        with torch.inference_mode():
            want = model.generate(  # type: ignore[attr-defined]
                input_ids,
                max_new_tokens=16,
                do_sample=False,
                num_beams=3,
                num_return_sequences=3,
                length_penalty=1.0,
                early_stopping=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        body = {
            "inputs": text,
            "parameters": {"num_beams": 3, "max_new_tokens": 16, "details": True},
        }
        answer = httpx.post(f"{two_shards.url}/generate", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        details = answer.json()["details"]
        beams = [details, *details["best_of_sequences"]]
        pad = tokenizer.pad_token_id  # type: ignore[attr-defined]
        for i, beam in enumerate(beams):
            ids = [t["id"] for t in beam["tokens"]]
            expected = want.sequences[i, input_ids.shape[1] :].tolist()
            assert ids == expected[: len(ids)], (prompt, i)
            assert all(t == pad for t in expected[len(ids) :]), (prompt, i)
            score = sum(t["logprob"] for t in beam["tokens"]) / len(ids)
            assert score == pytest.approx(want.sequences_scores[i].item(), abs=2e-3), (prompt, i)


def _tiny_opt(path: Path, tokenizer_dir: str) -> tuple[Path, int]:
    """A random OPT with SmolLM2's tokenizer (its vocabulary size), saved as safetensors."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    eos = json.loads((Path(tokenizer_dir) / "config.json").read_text())["eos_token_id"]
    torch.manual_seed(0)
    config = OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=49152,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = OPTForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path, eos


def test_an_opt_checkpoint_is_served_over_two_shards_as_transformers_generates(
    tmp_path: Path, smollm_dir: str
) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model_dir, eos = _tiny_opt(tmp_path / "tiny-opt", smollm_dir)
    text = "The history of numbers"
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    reference = out[0, len(ids) :].tolist()
    reference = reference_up_to_eos(reference, eos)

    server = launch(
        tmp_path,
        *(
            "--model-id",
            str(model_dir),
            "--num-shard",
            "2",
            *FLOAT32,
        ),
        *("--kv-cache-memory", "16MiB", "--check-rank-agreement"),
    )
    try:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            assert greedy_ids(http, text, 16) == reference
    finally:
        assert stop(server) == 0, server.log()

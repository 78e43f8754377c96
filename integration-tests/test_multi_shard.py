"""`cadence launch --num-shard 2`: two shard processes in a gloo group serve a tiny random
Llama whose heads split as SmolLM2's do (3 KV heads: 2 + 1 a rank) with the same greedy,
constrained and beam-search tokens as one shard and as transformers, every step checked
rank against rank; an OPT checkpoint is served end to end and generates what transformers
generates. (The split is the point, not the embedded model: the model has about a sixth of
SmolLM2's weights. SmolLM2's own beams, ending at its EOS, are checked in test_beam_search.)"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from beam_reference import assert_beams_as_transformers
from invariance import PROMPTS, assert_same_answers

from conftest import (
    CHAT_PROMPTS,
    FLOAT32,
    LaunchedServer,
    greedy_ids,
    greedy_ids_together,
    greedy_reference,
    launch,
    reference_up_to_eos,
    stop,
    tiny_gqa_model,
)

NEW_TOKENS = 32
BLOCKS = 1024  # 16-token blocks, each rank's


@pytest.fixture(scope="module")
def two_shards(
    tmp_path_factory: pytest.TempPathFactory, tiny_gqa_dir: str
) -> Iterator[LaunchedServer]:
    """The tiny GQA Llama in float32 over 2 ranks (its 6 heads / 3 KV heads split
    unevenly)."""
    tmp = tmp_path_factory.mktemp("gqa-tp2")
    server = launch(
        tmp,
        *("--num-shard", "2", *tiny_gqa_model(tiny_gqa_dir, BLOCKS)),
        "--check-rank-agreement",
    )
    yield server
    code = stop(server)
    assert code == 0, f"launcher exited with {code} on SIGTERM:\n{server.log()}"


@pytest.fixture(scope="module")
def one_shard(
    tmp_path_factory: pytest.TempPathFactory, tiny_gqa_dir: str
) -> Iterator[httpx.Client]:
    """The same model on one shard: what two must answer alike."""
    server = launch(tmp_path_factory.mktemp("gqa-tp1"), *tiny_gqa_model(tiny_gqa_dir, BLOCKS))
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client
    assert stop(server) == 0, server.log()


@pytest.fixture(scope="module")
def gqa_reference(tiny_gqa_dir: str) -> tuple[object, object]:
    """transformers' tokenizer and float32 model on the tiny GQA Llama."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gqa_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_gqa_dir, dtype=torch.float32).eval()
    return tokenizer, model


def test_two_shards_generate_the_same_greedy_tokens_as_one_and_as_transformers(
    two_shards: LaunchedServer, one_shard: httpx.Client, gqa_reference: tuple[object, object]
) -> None:
    texts, expected, _ = greedy_reference(*gqa_reference, CHAT_PROMPTS[:4], NEW_TOKENS)
    with httpx.Client(base_url=two_shards.url, timeout=300) as tp:
        info = tp.get("/info").json()
        ones = greedy_ids_together(one_shard, texts, NEW_TOKENS)
        twos = greedy_ids_together(tp, texts, NEW_TOKENS)
    for text, want, one, two in zip(texts, expected, ones, twos, strict=True):
        assert one == want, text
        assert two == one, text
    assert info["world_size"] == 2
    log = two_shards.log()
    assert "rank 1/2" in log and "disagrees" not in log


def test_two_shards_answer_alike_alone_in_a_crowd_and_again(two_shards: LaunchedServer) -> None:
    """Batch invariance across ranks: each all-reduce adds the two parts in one order."""
    assert_same_answers(two_shards.url, PROMPTS[:4], seeded=2, max_tokens=10, crowd=12)


def test_two_shards_give_the_same_constrained_greedy_tokens_as_one(
    two_shards: LaunchedServer, one_shard: httpx.Client
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
        ones = greedy_ids_together(one_shard, texts, 48, case_grammars)
        twos = greedy_ids_together(tp, texts, 48, case_grammars)
    for case, one, two in zip(cases, ones, twos, strict=True):
        assert one == two, case
    assert "disagrees" not in two_shards.log()


def test_two_shards_search_beams_as_transformers_does(
    two_shards: LaunchedServer, gqa_reference: tuple[object, object]
) -> None:
    """Beam search over 2 ranks: the beams and scores of transformers' float32 search."""
    assert_beams_as_transformers(two_shards.url, *gqa_reference, CHAT_PROMPTS[:2])


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

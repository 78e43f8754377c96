"""Tensor parallelism on CPU (gloo): every family's logits through 2 ranks, each holding
half of every layer, match transformers on the same weights, on every rank, for a
prefill, decodes and a request joining a running batch; each rank holds and reads about
half of the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shard_helpers import hf_logits
from tp_worker import run_group, script_tokens

TOL = 1e-4
FAMILIES = [
    "llama_gqa",
    "llama_kv1_odd_vocab",  # 1 KV head for 2 ranks (replicated), vocabulary of 257
    "llama_9_heads_3_kv",  # uneven: 2 KV groups (6 heads) on rank 0, 1 (3 heads) on rank 1
    "qwen2",
    "mistral_window",
    "opt",
    "opt_350m",  # post-LayerNorm, project_in/out, vocabulary of 257
    "gpt2",
]


@pytest.fixture(scope="module")
def two_ranks(model_dirs, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One 2-rank gloo group runs the scripted steps on every family."""
    dirs = [str(model_dirs(name)) for name in FAMILIES]
    return run_group(2, dirs, tmp_path_factory.mktemp("tp2"), "float32")


def reference(hf, name: str) -> dict[int, torch.Tensor]:
    p1, f1, p2, f2 = script_tokens()
    full1 = hf_logits(hf, p1 + f1)[:-1]  # the last forced token is never computed
    full2 = hf_logits(hf, p2 + f2)
    return {1: full1, 2: full2}


@pytest.mark.parametrize("name", FAMILIES)
def test_two_ranks_match_transformers_on_every_rank(name, two_ranks, model_dirs, hf_model):
    ref = reference(hf_model(model_dirs(name)), name)
    for rank, results in enumerate(two_ranks):
        got = results[name]["logits"]
        for rid in (1, 2):
            n = got[rid].shape[0]
            assert n > 1
            torch.testing.assert_close(
                got[rid], ref[rid][:n], atol=TOL, rtol=0, msg=f"rank {rank} request {rid}"
            )


def test_kv_heads_are_split_or_replicated(two_ranks):
    assert two_ranks[0]["llama_gqa"]["kv_heads"] == 1  # 2 KV heads over 2 ranks
    assert two_ranks[1]["llama_kv1_odd_vocab"]["kv_heads"] == 1  # 1 KV head, replicated
    uneven = [r["llama_9_heads_3_kv"]["kv_heads"] for r in two_ranks]
    assert uneven == [2, 1]


@pytest.mark.parametrize("name", ["llama_gqa", "opt", "gpt2"])
def test_each_rank_holds_and_reads_about_half_the_weights(name, two_ranks, model_dirs):
    from cadence.models import load_model

    whole = load_model(model_dirs(name), "float32", "cpu")
    single = sum(
        p.numel() * p.element_size() for p in {id(p): p for p in whole.parameters()}.values()
    )
    for results in two_ranks:
        held = results[name]["weight_bytes"] / single
        read = results[name]["checkpoint_bytes_read"] / whole.checkpoint_bytes_read
        # norms, biases and position tables are replicated: a little over half
        assert 0.5 <= held < 0.56, held
        assert 0.5 <= read < 0.56, read


def test_tensor_parallel_worker_reads_no_transformers():
    """The ranks are spawned fresh; keeping transformers out of them keeps the test fast."""
    source = (Path(__file__).parent / "tp_worker.py").read_text()
    assert "import transformers" not in source and "from transformers" not in source

"""The triton attention backend passes the same transformers-equivalence tests as the
torch one (on CPU under the Triton interpreter, on a GPU compiled), and the switch
picks what each device should run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import test_model
import torch
from cadence.layers.attention import select_backend
from cadence.shard.engine import Engine


@pytest.fixture
def triton_engine_for(
    monkeypatch: pytest.MonkeyPatch, engine_for: Callable[..., Engine]
) -> Callable[..., Engine]:
    monkeypatch.setenv("CADENCE_ATTENTION_BACKEND", "triton")

    def make(model_dir: Path, **kwargs: object) -> Engine:
        engine = engine_for(model_dir, **kwargs)
        assert engine.attention_backend == "triton"
        return engine

    return make


@pytest.mark.parametrize(
    "variant", ["llama_gqa", "llama_9_heads_3_kv", "llama_kv1_odd_vocab", "mistral_window"]
)
def test_triton_backend_prefill_and_decode_match_transformers(
    variant, model_dirs, hf_model, triton_engine_for
):
    test_model.test_prefill_and_ten_decode_steps_match_transformers(
        variant, model_dirs, hf_model, triton_engine_for
    )


def test_triton_backend_chunked_prefill(model_dirs, hf_model, triton_engine_for):
    test_model.test_chunked_prefill_in_three_chunks_matches_transformers(
        model_dirs, hf_model, triton_engine_for
    )


def test_triton_backend_mixed_prefill_and_decode_batch(model_dirs, hf_model, triton_engine_for):
    test_model.test_mixed_batch_of_prefills_and_decodes_matches_each_sequence_alone(
        model_dirs, hf_model, triton_engine_for
    )


def test_backend_switch_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend(None, torch.device("cpu")) == "torch"
    assert select_backend("auto", torch.device("cpu")) == "torch"
    assert select_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("triton", torch.device("cpu"))

"""Every attention backend passes the same transformers-equivalence tests: `cpu` (the
C++ kernels, the CPU default, which the rest of the suite runs), `torch` (the fallback
without a compiler) and `triton` (on CPU under the Triton interpreter, on a GPU
compiled); and the switch picks what each device should run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import test_model
import torch
from cadence.layers.attention import select_backend
from cadence.shard.engine import Engine


def _engine_with_backend(
    backend: str, monkeypatch: pytest.MonkeyPatch, engine_for: Callable[..., Engine]
) -> Callable[..., Engine]:
    monkeypatch.setenv("CADENCE_ATTENTION_BACKEND", backend)

    def make(model_dir: Path, **kwargs: object) -> Engine:
        engine = engine_for(model_dir, **kwargs)
        assert engine.attention_backend == backend
        return engine

    return make


@pytest.fixture
def triton_engine_for(
    monkeypatch: pytest.MonkeyPatch, engine_for: Callable[..., Engine]
) -> Callable[..., Engine]:
    return _engine_with_backend("triton", monkeypatch, engine_for)


@pytest.fixture
def torch_engine_for(
    monkeypatch: pytest.MonkeyPatch, engine_for: Callable[..., Engine]
) -> Callable[..., Engine]:
    return _engine_with_backend("torch", monkeypatch, engine_for)


@pytest.mark.parametrize(
    "variant", ["llama_gqa", "llama_9_heads_3_kv", "llama_kv1_odd_vocab", "mistral_window"]
)
def test_torch_backend_prefill_and_decode_match_transformers(
    variant, model_dirs, hf_model, torch_engine_for
):
    test_model.test_prefill_and_ten_decode_steps_match_transformers(
        variant, model_dirs, hf_model, torch_engine_for
    )


def test_torch_backend_mixed_prefill_and_decode_batch(model_dirs, hf_model, torch_engine_for):
    test_model.test_mixed_batch_of_prefills_and_decodes_matches_each_sequence_alone(
        model_dirs, hf_model, torch_engine_for
    )


def test_cpu_backend_is_the_cpu_default(model_dirs, engine_for) -> None:
    engine = engine_for(model_dirs("llama_gqa"))
    assert engine.attention_backend == "cpu"


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
    assert select_backend(None, torch.device("cpu")) == "cpu"  # the C++ kernels build here
    assert select_backend("auto", torch.device("cpu")) == "cpu"
    assert select_backend("torch", torch.device("cpu")) == "torch"
    assert select_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="CPU devices only"):
        select_backend("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("triton", torch.device("cpu"))

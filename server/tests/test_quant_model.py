"""Tiny Llama models served quantized, through the engine and the flat CPU runner:

- the products go through the quantized kernels exactly: a model loaded from a quantized
  source gives the logits of the float model whose linears hold the dequantized weights
  (tight bound), with or without a float copy kept for prefill rows;
- `--quantize` at load quantizes as the source does (same logits, bit for bit);
- the formats are right: logits stay within a bound of the float model's, which a
  quantization off by one int4 level (a wrong centring) exceeds;
- a tied LM head is quantized while the embedding keeps its float table.
"""

from __future__ import annotations

import cadence.models
import pytest
import torch
from quant_sources import QuantizedCopy, dequantized_copy, write_crossover
from shard_helpers import MiniRouter

PROMPT = list(range(3, 20))
DECODES = 6
# RMS logit difference between the quantized kernels and dequantize-then-float, relative
# to the RMS logit: where the C++ integer product serves (AVX-512 VNNI, AVX2) activations are
# rounded to int8 per block of 32 columns, measured up to 0.039 on these chaotic tiny
# models; torch's kernels elsewhere compute in bfloat16, measured up to 0.016.
KERNEL_PATH_BOUND = 0.06
# RMS logit error relative to the float model's RMS logit, on these tiny random models
# (weights N(0, 0.15), chaotic enough that int4 g32 measures 0.38; a one-level shift
# measures 2.2, int8 0.03).
FORMAT_BOUND = {"int8": 0.06, "int4": 0.6}


def _logits(engine) -> torch.Tensor:
    """A prompt's prefill then decode steps: every computed row's logits."""
    router = MiniRouter(engine, seed=1)
    outs = [router.logits_step(joined=[router.join(1, PROMPT)], forced={1: 5})[1]]
    for t in range(DECODES):
        outs.append(router.logits_step(continuing=[router.cont(1)], forced={1: 7 + t})[1])
    return torch.cat(outs)


def _rms_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


@pytest.fixture
def served(engine_for, monkeypatch, tmp_path):
    """Logits of `model_dir` served from `source` (or as a float checkpoint), with the
    built-in crossover table (not one a bench wrote to this machine's cache)."""

    def run(model_dir, source=None, **config) -> tuple[torch.Tensor, object]:
        monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path / "cache"))
        if source is not None:
            monkeypatch.setattr(cadence.models, "open_quantized_checkpoint", lambda _: source)
        engine = engine_for(model_dir, **config)
        monkeypatch.undo()
        return _logits(engine), engine

    return run


@pytest.mark.parametrize("keep_float", ["on", "off"])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama_gqa", "llama_bias", "qwen2"])
def test_a_quantized_source_computes_the_dequantized_models_logits(
    name, method, keep_float, model_dirs, served, tmp_path
):
    source = QuantizedCopy(model_dirs(name), method)
    got, engine = served(model_dirs(name), source, quantize_keep_float=keep_float)
    expected, _ = served(dequantized_copy(source, tmp_path / "dequantized"))
    assert _rms_error(got, expected) < KERNEL_PATH_BOUND
    q = engine.quantization
    assert q["source"] == "test copy " + method
    assert q["float_kept"] is (keep_float == "on")
    layers = engine.model.config.num_layers
    assert sum(q["formats"].values()) == 4 * layers + (name != "qwen2")  # + untied head


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_at_load_is_the_sources_quantization(method, model_dirs, served):
    model_dir = model_dirs("llama_gqa")
    at_load, engine = served(
        model_dir, quantize=method, quantize_group_size=32, quantize_keep_float="off"
    )
    source = QuantizedCopy(model_dir, method, 32, head_method="int8")
    from_source, _ = served(model_dir, source, quantize_keep_float="off")
    assert torch.equal(at_load, from_source)
    layers = 4 * engine.model.config.num_layers
    expected = {"int8": layers + 1} if method == "int8" else {"int4 g32": layers, "int8": 1}
    assert engine.quantization["formats"] == expected  # the LM head in int8 either way
    assert engine.quantization["source"].startswith(f"{method} at load")
    assert "kernels" in engine.kernels["products"]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama_gqa", "opt", "gpt2"])
def test_quantized_logits_stay_near_the_float_models(name, method, model_dirs, served):
    model_dir = model_dirs(name)
    reference, _ = served(model_dir)
    got, _ = served(model_dir, quantize=method, quantize_group_size=32, quantize_keep_float="off")
    assert _rms_error(got, reference) < FORMAT_BOUND[method]


def test_the_format_bound_catches_an_int4_weight_off_by_one_level(model_dirs, served):
    model_dir = model_dirs("llama_gqa")
    reference, _ = served(model_dir)
    shifted = QuantizedCopy(model_dir, "int4", 32, shift_levels=1)
    got, _ = served(model_dir, shifted, quantize_keep_float="off")
    assert _rms_error(got, reference) > FORMAT_BOUND["int4"]


def test_a_kept_float_copy_serves_the_prefill_exactly(model_dirs, served, tmp_path):
    """With the float weights kept (and batch invariance off: it keeps one kernel), the
    prefill rows (more than the crossover) are the float model's exactly; the decode rows
    are quantized."""
    model_dir = model_dirs("llama_gqa")
    reference, _ = served(model_dir, deterministic=False)
    write_crossover(tmp_path / "cache", 4)  # the table `served` reads
    got, engine = served(model_dir, quantize="int8", quantize_keep_float="on", deterministic=False)
    crossover = engine.quantization["crossover"]["int8"]
    assert crossover["from"].startswith("measured") and crossover["rows"] == 4
    prefill = len(PROMPT)
    assert torch.equal(got[:prefill], reference[:prefill])
    assert not torch.equal(got[prefill:], reference[prefill:])


def test_a_tied_head_is_quantized_and_the_embedding_stays_float(model_dirs, served):
    from safetensors.torch import load_file

    model_dir = model_dirs("llama_mha_tied")
    _, engine = served(model_dir, quantize="int8", quantize_keep_float="off")
    model = engine.model
    (path,) = model_dir.glob("*.safetensors")
    table = load_file(str(path))["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, table)
    assert model.lm_head.quantized is not None
    assert model.lm_head.quantized.float_kept  # it is the embedding: nothing to save
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0  # the others dropped


def test_bfloat16_activations_run_the_kernels_in_bfloat16(model_dirs, served, tmp_path):
    model_dir = model_dirs("llama_gqa")
    source = QuantizedCopy(model_dir, "int4")
    got, _ = served(model_dir, source, dtype="bfloat16", quantize_keep_float="off")
    expected, _ = served(dequantized_copy(source, tmp_path / "deq"), dtype="bfloat16")
    reference, _ = served(model_dir)
    # bfloat16 rounding on both sides, through 2 layers: far below the format's error
    assert _rms_error(got, expected) < 0.05
    assert _rms_error(got, reference) < FORMAT_BOUND["int4"]


def test_quantize_refuses_an_already_quantized_checkpoint(model_dirs, engine_for, monkeypatch):
    model_dir = model_dirs("llama_gqa")
    source = QuantizedCopy(model_dir, "int8")
    monkeypatch.setattr(cadence.models, "open_quantized_checkpoint", lambda _: source)
    with pytest.raises(ValueError, match="already quantized"):
        engine_for(model_dir, quantize="int4")


def test_info_fields_say_what_is_quantized_and_how(model_dirs, served, tmp_path):
    model_dir = model_dirs("llama_gqa")
    _, plain = served(model_dir)
    assert plain.quantization_fields() == {"weights": "float32", "kv_cache_dtype": "float32"}
    write_crossover(tmp_path / "cache", 6)
    _, engine = served(model_dir, quantize="int4", quantize_group_size=32, quantize_keep_float="on")
    fields = engine.quantization_fields()
    assert fields["weights"] == "int4 g32, int8"  # the LM head is int8
    assert fields["source"] == "int4 at load (group 32, LM head int8)"
    assert fields["float_copy"] == "kept"
    assert fields["quantized_max_rows"].startswith("int4: 6 (measured")
    assert all(isinstance(v, str) for v in engine.info().quantization.values())

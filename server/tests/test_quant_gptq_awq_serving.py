"""GPTQ and AWQ folders served by the engine give the logits transformers computes from
the weights those checkpoints stand for (their dequantization, written as a plain float
folder)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_sources import write_crossover
from quantized_checkpoints import awq_config, gptq_config, write_dequantized, write_quantized
from shard_helpers import hf_logits, prefill_then_decode_logits
from transformers import AutoModelForCausalLM

# Largest |logit difference| relative to the largest |logit| where the float copy (the
# dequantized weights) serves: float32 summation order only.
TOL = 1e-4
# RMS logit error relative to the oracle's RMS logit where the quantized CPU kernels
# serve: int8 activations or bfloat16 compute (see test_quant_model.py's KERNEL_PATH_BOUND).
KERNEL_PATH_BOUND = 0.06


def _rms_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


CASES = {
    "gptq_v1_sym_g32": gptq_config(group_size=32),
    "gptq_v2_asym_act_order_g32": gptq_config(
        checkpoint_format="gptq_v2", sym=False, desc_act=True
    ),
    "gptq_v1_int8_sym": gptq_config(bits=8, group_size=-1),
    "awq_g32": awq_config(group_size=32),
}
DESCRIPTIONS = {
    "gptq_v1_sym_g32": "gptq int4 g32",
    "gptq_v2_asym_act_order_g32": "gptq int4 g32 desc_act",
    "gptq_v1_int8_sym": "gptq int8 per-channel",
    "awq_g32": "awq int4 g32",
}


@pytest.mark.parametrize("keep_float", ["on", "off"])  # off: every product quantized
@pytest.mark.parametrize("case", sorted(CASES))
def test_served_logits_equal_transformers_on_the_dequantized_weights(
    case: str,
    keep_float: str,
    model_dirs: Callable[[str], Path],
    engine_for: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    float_dir = model_dirs("llama_gqa")
    qc = CASES[case]
    dequantized = write_quantized(
        float_dir, tmp_path / "quantized", qc, act_order_seed=2 if qc.get("desc_act") else None
    )
    write_dequantized(float_dir, tmp_path / "oracle", dequantized)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path / "oracle", dtype=torch.float32).eval()
    tokens = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(oracle, tokens)[:-1]
    # the test has teeth: quantization moved the logits well beyond both bounds
    original = hf_logits(
        AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval(), tokens
    )[:-1]
    scale = float(ref.abs().max())
    assert (original - ref).abs().max() > 100 * TOL * scale

    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path / "cache"))
    write_crossover(tmp_path / "cache", 4)  # the 16 prefill rows to the kept float copy
    engine = engine_for(tmp_path / "quantized", quantize_keep_float=keep_float)
    ours = prefill_then_decode_logits(engine, tokens, 16)
    if keep_float == "on":  # the 16 prefill rows: the float copy, exactly
        torch.testing.assert_close(ours[:16], ref[:16], atol=TOL * scale, rtol=0)
    assert _rms_error(ours, ref) < KERNEL_PATH_BOUND
    # and nearer the checkpoint's numbers than the float model it was made from (int8
    # per channel moves these logits by ~3% RMS, as much as int8 activations do; int4 by
    # far more)
    assert _rms_error(ours, ref) < _rms_error(ours, original)
    served = engine.quantization
    assert served["source"] == DESCRIPTIONS[case]
    assert served["float_kept"] is (keep_float == "on")
    # every linear of both layers (fused q/k/v, o, fused gate/up, down) is quantized
    fmt = "int8" if qc["bits"] == 8 else "int4 g32"
    assert served["formats"] == {fmt: 4 * 2}

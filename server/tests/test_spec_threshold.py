"""The speculative load threshold the shard reports: the benchmark's measured value from
the cache folder, else the device's default."""

from __future__ import annotations

import json

import torch
from cadence.speculative.threshold import DEFAULTS, speculative_threshold


def test_a_measured_threshold_wins_over_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert speculative_threshold(cpu) == (DEFAULTS["cpu"], "default (cpu)")
    assert speculative_threshold(cuda) == (DEFAULTS["cuda"], "default (cuda)")
    path = tmp_path / "speculative.json"
    measured = {"max_step_tokens": 40, "device": "cpu", "isa": "avx2", "dtype": "float32"}
    path.write_text(json.dumps({**measured, "model": "m"}))
    assert speculative_threshold(cpu) == (40, f"measured {path}")
    assert speculative_threshold(cpu, isa="avx2", dtype="float32", model="m")[0] == 40
    # measured for another instruction set or dtype: the default applies, and says why
    threshold, source = speculative_threshold(cpu, isa="avx512_bf16", dtype="float32", model="m")
    assert threshold == DEFAULTS["cpu"] and "isa avx2" in source, source
    threshold, source = speculative_threshold(cpu, isa="avx2", dtype="bfloat16", model="m")
    assert threshold == DEFAULTS["cpu"] and "dtype float32" in source, source
    assert speculative_threshold(cuda, isa="cuda")[0] == DEFAULTS["cuda"]


def test_info_reports_the_threshold_and_no_draft_model(
    tmp_path, monkeypatch, model_dirs, engine_for
):
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    (tmp_path / "speculative.json").write_text(json.dumps({"max_step_tokens": 24}))
    info = engine_for(model_dirs("llama_gqa")).info()
    assert info.speculative_max_step_tokens == 24
    assert info.speculative_threshold_source.startswith("measured ")
    assert info.draft_model == ""

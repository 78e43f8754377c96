"""benchmarks/kernels/spec_threshold_bench.py: the threshold rule, the router's block bookkeeping it
mirrors against a real engine's, and the file it writes, read back by the shard's
`speculative_threshold`."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from cadence.speculative.threshold import speculative_threshold

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "spec_threshold_bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spec_threshold_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_threshold_is_the_largest_step_whose_proposals_still_pay(bench: ModuleType) -> None:
    assert bench.expected_tokens(0.5, 0) == 1.0
    assert bench.expected_tokens(0.5, 3) == pytest.approx(1.875)
    # Weight-bound at one and two requests, compute-bound at eight.
    times = {(1, 0): 10.0, (1, 4): 12.0, (2, 0): 11.0, (2, 3): 16.0, (8, 0): 20.0, (8, 1): 40.0}
    # gains at a = 0.7: (1, 4) 2.77 * 10 / 12 = 2.3; (2, 3) 2.53 * 11 / 16 = 1.74;
    # (8, 1) 1.7 * 20 / 40 = 0.85: the largest step that pays holds 2 * 4 tokens
    assert bench.threshold(times) == 8
    assert bench.threshold(times, acceptance=0.9, min_gain=1.6) == 8
    assert bench.threshold(times, acceptance=0.3, min_gain=1.1) == 5
    assert bench.threshold({(1, 0): 10.0, (1, 1): 20.0}) == 1
    assert bench.step_ms_by_tokens(times) == {1: 10.0, 2: 11.0, 5: 12.0, 8: 20.0, 16: 40.0}
    assert bench.configurations((1, 4), (0, 1, 8), 9) == [(1, 0), (1, 1), (4, 0), (4, 1), (1, 8)]


def test_block_tables_follow_the_engines_cuts(
    bench: ModuleType, model_dirs: Callable[[str], Path]
) -> None:
    engine = bench.build_engine(str(model_dirs("llama_gqa")), "float32", "auto")
    engine.warmup(40, 4, 200 * engine.bytes_per_block)
    requests = bench.DecodingRequests(engine, 3, 30, step_tokens=40)
    state = engine.state
    for b, k in [(3, 8), (2, 0), (3, 5), (1, 8), (3, 8), (2, 3)] * 3:
        requests.step(b, k)
        for rid, r in requests.requests.items():
            slot = state.slot_of[rid]
            assert int(state.computed[slot]) == r.computed
            held = state.block_tables[slot, : int(state.num_block_ids[slot])].tolist()
            assert held == r.blocks
    # every block is either held by a request or free, once
    owned = [b for r in requests.requests.values() for b in r.blocks]
    assert sorted(owned + requests.free) == list(range(engine.kv.num_blocks))


def test_write_stores_the_threshold_the_shard_reads(
    bench: ModuleType,
    model_dirs: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    model = model_dirs("llama_gqa")
    argv = ["--model-id", str(model), "--dtype", "float32", "--batches", "1,2"]
    argv += ["--proposals", "0,1,3", "--context", "20", "--rounds", "1", "--steps", "1"]
    result = bench.main([*argv, "--write"])
    path = tmp_path / "speculative.json"
    stored = json.loads(path.read_text())
    assert stored == json.loads(json.dumps(result))
    assert set(stored) >= {"max_step_tokens", "acceptance", "step_ms", "device", "isa", "dtype"}
    assert stored["acceptance"] == 0.7 and stored["device"] == "cpu"
    assert stored["dtype"] == "float32" and stored["model"] == model.name
    # B in {1, 2} times 1 + k in {1, 2, 4}
    assert sorted(map(int, stored["step_ms"])) == [1, 2, 4, 8]
    rows = {(c["batch"], c["k"]): c["ms"] for c in stored["configurations"]}
    assert stored["max_step_tokens"] == bench.threshold(rows)
    assert speculative_threshold(torch.device("cpu")) == (
        stored["max_step_tokens"],
        f"measured {path}",
    )

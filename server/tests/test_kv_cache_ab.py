"""benchmarks/kernels/kv_cache_ab.py: two engines, one per KV cache dtype, fed the same
steps in turn, and the ratios it prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "kv_cache_ab.py"


def test_both_caches_serve_the_same_steps_and_the_ratios_are_printed(
    model_dirs, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("kv_cache_ab", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = str(model_dirs("llama_gqa"))
    script.main(["bfloat16", "int8", "--batch", "4", "--prompt", "24", "--decode-steps", "4",
                 "--kv-mib", "8", "--model-id", model])  # fmt: skip
    out = capsys.readouterr().out
    assert "A: bfloat16 cache, B: int8 cache" in out
    for line in ("prompts' steps: B / A median", "decode steps: B / A median", "charter's mix"):
        assert line in out, out
    with pytest.raises(SystemExit):
        script.main(["int8", "int8", "--model-id", model])  # the two sides must differ

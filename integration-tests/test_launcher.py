"""The launcher fails loudly when a child cannot start or the router cannot warm the
shards up, and stops cleanly on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_launch_with_a_broken_model_exits_nonzero_with_the_shard_log(tmp_path: Path) -> None:
    model_dir = tmp_path / "broken-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "no-such-architecture"}')
    result = subprocess.run(
        [sys.executable, "-m", "cadence", "launch", "--model-id", str(model_dir), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "no-such-architecture" in result.stdout + result.stderr


def test_a_failed_warmup_exits_nonzero_with_the_shards_message(tiny_llama_dir: str) -> None:
    """The router warms the shards up; 1 byte of KV cache holds no block."""
    launch = [sys.executable, "-m", "cadence", "launch", "--model-id", tiny_llama_dir]
    result = subprocess.run(
        [*launch, "--kv-cache-memory", "1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    error = result.stdout + result.stderr
    assert "router exited with code 1" in error
    assert (
        "shard 0: Internal: warmup failed: RuntimeError: no memory left for the KV cache"
        in (error.split("router exited with code 1")[1])
    )

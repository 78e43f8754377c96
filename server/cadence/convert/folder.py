"""Converts a GGUF file into a Hugging Face model folder, atomically and once."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

if TYPE_CHECKING:
    from cadence.convert.gguf import GGUFModel

DTYPES = ("float32", "bfloat16", "float16")
# The files a finished folder holds (the folder is renamed into place only once complete).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def convert_gguf(gguf_path: str | Path, output: str | Path, dtype: str = "float32") -> Path:
    """Writes `output` (config, generation config, tokenizer, model.safetensors) from a GGUF.

    Returns at once if `output` is already a finished folder. Everything is written into a
    temporary folder beside `output` and renamed into place at the end, so a reader never
    sees half a model and two racing conversions both end with one finished folder.
    """
    output = Path(output).expanduser()
    if is_converted(output):
        return output
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    output.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("converting {} into {} ({})", gguf_path, output, dtype)
    from cadence.convert.gguf import GGUFModel  # torch and gguf only when there is work

    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        _write_folder(GGUFModel(gguf_path), tmp, dtype)
        _make_readable(tmp)
        _publish(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted in {:.1f} s", time.perf_counter() - started)
    return output


def _write_folder(model: GGUFModel, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from cadence.convert.tokenizer import write_tokenizer

    config = model.hf_config() | {"torch_dtype": dtype}
    _write_json(out / "generation_config.json", model.generation_config())
    write_tokenizer(model, out)
    tensors = dict(
        tqdm(
            model.hf_tensors(getattr(torch, dtype)),
            total=len(model.tensor_names),
            desc="dequantizing",
            unit="tensor",
        )
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)


def _publish(tmp: Path, output: Path) -> None:
    if output.exists() and not is_converted(output):
        logger.warning("replacing the unfinished folder {}", output)
        shutil.rmtree(output)
    try:
        os.rename(tmp, output)
    except OSError:
        if not is_converted(output):  # lost a race only if the winner finished
            raise
        logger.info("{} was converted meanwhile by another process", output)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; the model folder is an ordinary shared cache entry."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

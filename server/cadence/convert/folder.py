"""Makes a Hugging Face model folder from a GGUF file, atomically and once.

Two kinds: the folder cadence serves a GGUF from (`gguf_folder`: config, generation
config, tokenizer, and `weights.gguf`, a link to the file itself, whose weights the shard
reads as they are), and a float copy for other tools (`convert_gguf`: the same plus
model.safetensors, every tensor dequantized).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from cadence.quant.checkpoints import GGUF_WEIGHTS

if TYPE_CHECKING:
    from cadence.convert.gguf import GGUFModel

DTYPES = ("float32", "bfloat16", "float16")
# The files each finished folder holds (a folder is renamed into place only once complete).
_METADATA_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
REQUIRED_FILES = (*_METADATA_FILES, "model.safetensors")
GGUF_FOLDER_FILES = (*_METADATA_FILES, GGUF_WEIGHTS)


def is_converted(folder: Path) -> bool:
    """A finished float copy."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def is_gguf_folder(folder: Path, gguf_path: str | Path) -> bool:
    """A finished folder serving `gguf_path` (its link leads to that very file)."""
    link = folder / GGUF_WEIGHTS
    return (
        all((folder / name).is_file() for name in GGUF_FOLDER_FILES)
        and link.resolve() == Path(gguf_path).resolve()
    )


def gguf_folder(gguf_path: str | Path, output: str | Path) -> Path:
    """Makes `output` serve `gguf_path`: config, generation config and tokenizer from the
    file's metadata, and `weights.gguf` linking the file. Returns at once if `output`
    already does; anything else there (a float copy an older cadence made, a folder for
    another file) is replaced."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    output = Path(output).expanduser()
    if is_gguf_folder(output, gguf_path):
        return output

    def write(model: GGUFModel, out: Path) -> None:
        _write_metadata(model, out, model.hf_config())
        (out / GGUF_WEIGHTS).symlink_to(gguf_path)

    return _build(gguf_path, output, lambda f: is_gguf_folder(f, gguf_path), write)


def convert_gguf(gguf_path: str | Path, output: str | Path, dtype: str = "float32") -> Path:
    """Writes `output` (config, generation config, tokenizer, model.safetensors) from a GGUF.

    Returns at once if `output` is already a finished float copy.
    """
    output = Path(output).expanduser()
    if is_converted(output):
        return output
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")

    def write(model: GGUFModel, out: Path) -> None:
        _write_metadata(model, out, model.hf_config() | {"torch_dtype": dtype})
        _write_safetensors(model, out, dtype)

    return _build(Path(gguf_path), output, is_converted, write)


def _build(
    gguf_path: Path,
    output: Path,
    finished: Callable[[Path], bool],
    write: Callable[[GGUFModel, Path], None],
) -> Path:
    """Everything is written into a temporary folder beside `output` and renamed into
    place at the end, so a reader never sees half a model and two racing builds both end
    with one finished folder."""
    output.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("making {} from {}", output, gguf_path)
    from cadence.convert.gguf import GGUFModel  # torch and gguf only when there is work

    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        write(GGUFModel(gguf_path), tmp)
        _make_readable(tmp)
        _publish(tmp, output, finished)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("made {} in {:.1f} s", output.name, time.perf_counter() - started)
    return output


def _write_metadata(model: GGUFModel, out: Path, config: dict) -> None:
    from cadence.convert.tokenizer import write_tokenizer

    _write_json(out / "generation_config.json", model.generation_config())
    write_tokenizer(model, out)
    _write_json(out / "config.json", config)


def _write_safetensors(model: GGUFModel, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    tensors = dict(
        tqdm(
            model.hf_tensors(getattr(torch, dtype)),
            total=len(model.hf_names),
            desc="dequantizing",
            unit="tensor",
        )
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _publish(tmp: Path, output: Path, finished: Callable[[Path], bool]) -> None:
    if output.exists() and not finished(output):
        logger.warning("replacing {} (not a finished folder of this kind and file)", output)
        shutil.rmtree(output, ignore_errors=True)  # a racing build may be removing it too
    try:
        os.rename(tmp, output)
    except OSError:
        if not finished(output):  # lost a race only if the winner finished
            raise
        logger.info("{} was made meanwhile by another process", output)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; the model folder is an ordinary shared cache entry.
    The link is left alone: chmod would follow it to the GGUF file."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        if not path.is_symlink():
            path.chmod(0o644)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

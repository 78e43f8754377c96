"""The tensors of a safetensors model folder by name, wherever they are stored.

A quantized linear's parts (`qweight`, `qzeros`, `scales` …) may fall in different
shards of a sharded checkpoint, so a reader asks for tensors by name, not file by file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cadence.models.loader import checkpoint_files


class TensorFiles:
    """Every tensor name of a model folder's *.safetensors and the file that holds it."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}  # open files, read lazily through mmap
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: model_dir / file for name, file in weight_map.items()}
        else:
            for path in checkpoint_files(model_dir):
                self._file_of.update((name, path) for name in self._handle(path).keys())

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self._file_of[name]).get_tensor(name)

    def each(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor), file by file."""
        for name in sorted(names, key=lambda n: (self._file_of[n], n)):
            yield name, self.get(name)


def quantized_prefixes(names: Iterable[str], marker: str = "qweight") -> list[str]:
    """The module prefixes (`model.layers.0.mlp.up_proj`) that hold a `<prefix>.qweight`."""
    suffix = "." + marker
    return sorted(n[: -len(suffix)] for n in names if n.endswith(suffix))

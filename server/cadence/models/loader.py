"""Loads *.safetensors checkpoints (single file or sharded with an index) straight into
a model's parameters, through each parameter's `weight_loader`.

Every checkpoint tensor is handed to the loaders as a `CheckpointTensor`: a lazy view
of a safetensors slice that reads only the rows/columns a rank asks for. A model maps
each checkpoint name to one or more `Target`s (its parameter, the part of a fused layer,
whether the checkpoint stores the weight transposed, which rows of a fused checkpoint
tensor belong to it) with `weight_targets`; models without one use `packed_targets`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn


@dataclass(slots=True)
class Target:
    """Where (part of) a checkpoint tensor goes."""

    param: str  # our parameter's name
    shard_id: Any = None  # part of a fused layer ("q", "k", "v", 0, 1 …), None otherwise
    transposed: bool = False  # stored [in, out] (GPT-2's Conv1D), our layers want [out, in]
    rows: tuple[int, int] | None = None  # (start, count) along the output dimension


@dataclass(slots=True)
class ReadCounter:
    """Bytes actually read from the checkpoint files (what a rank pays for its slice)."""

    bytes: int = 0


def _bounds(key: slice, size: int) -> tuple[int, int]:
    start, stop, step = key.indices(size)
    if step != 1:
        raise ValueError("checkpoint views take contiguous slices only")
    return start, max(start, stop)


@dataclass(slots=True)
class CheckpointTensor:
    """A logical tensor over a safetensors slice: optionally transposed (2-D), optionally
    narrowed to `rows` along the logical first dimension. `view[a:b]`, `view[:, a:b]` and
    `view[:]` read only that part of the file."""

    source: Any  # a safetensors PySafeSlice
    transposed: bool = False
    rows: tuple[int, int] | None = None
    counter: ReadCounter = field(default_factory=ReadCounter)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.source.get_shape())
        if self.transposed and len(shape) == 2:
            shape = (shape[1], shape[0])
        if self.rows is not None:
            shape = (self.rows[1], *shape[1:])
        return shape

    def __getitem__(self, key: slice | tuple[slice, ...]) -> torch.Tensor:
        keys = key if isinstance(key, tuple) else (key,)
        shape = self.shape
        spans = [_bounds(k, n) for k, n in zip(keys, shape, strict=False)]
        spans += [(0, n) for n in shape[len(spans) :]]
        if self.rows is not None:
            offset = self.rows[0]
            spans[0] = (spans[0][0] + offset, spans[0][1] + offset)
        if self.transposed and len(spans) == 2:
            (r0, r1), (c0, c1) = spans
            out = self.source[c0:c1, r0:r1].t()
        elif len(spans) == 2:
            (r0, r1), (c0, c1) = spans
            out = self.source[r0:r1, c0:c1]
        else:
            out = self.source[spans[0][0] : spans[0][1]]
        self.counter.bytes += out.numel() * out.element_size()
        return out


def packed_targets(name: str, packed: dict[str, tuple[str, Any]]) -> list[Target]:
    """Checkpoint names of separate projections (`q_proj`, `gate_proj` …) onto the fused
    parameter that holds them (`qkv_proj` part "q" …)."""
    for ckpt, (ours, shard_id) in packed.items():
        if f".{ckpt}." in name:
            return [Target(name.replace(f".{ckpt}.", f".{ours}."), shard_id)]
    return [Target(name)]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def _targets(model: nn.Module, name: str) -> list[Target]:
    mapper = getattr(model, "weight_targets", None)
    if mapper is not None:
        return mapper(name)
    if "rotary_emb.inv_freq" in name:
        return []
    return packed_targets(name, getattr(model, "packed_modules", {}))


def _copy_whole(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.data.copy_(tensor)


class TensorSlice:
    """An in-memory tensor in the shape of a safetensors slice (what `CheckpointTensor`
    reads): the float tensors of a quantized source."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self.tensor[key]


class WeightFiller:
    """Puts checkpoint tensors into `model`'s parameters through their loaders, and
    knows which parameters are still empty."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.counter = ReadCounter()
        self.loaded: set[int] = set()  # ids of filled parameters (tied ones share the object)

    def targets(self, name: str) -> list[Target]:
        return _targets(self.model, name)

    def param(self, target: Target, name: str) -> nn.Parameter:
        param = self.params.get(target.param)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
        return param

    def put(self, name: str, source: Any) -> None:
        """`source`: a safetensors slice or a `TensorSlice`."""
        for target in self.targets(name):
            param = self.param(target, name)
            view = CheckpointTensor(source, target.transposed, target.rows, self.counter)
            loader = getattr(param, "weight_loader", None)
            with torch.no_grad():
                if loader is None:
                    _copy_whole(param, view[:], name)
                else:
                    loader(param, view, target.shard_id)
            self.loaded.add(id(param))

    def check_complete(self) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        missing = [n for n, p in params.items() if id(p) not in self.loaded]
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {missing[:8]}")


def load_weights(model: nn.Module, model_dir: Path) -> int:
    """Fills every parameter of `model`, reading only this rank's slices; raises if a
    parameter is left unloaded. Returns the bytes read from the checkpoint."""
    filler = WeightFiller(model)
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # safe_open is not a mapping
                filler.put(name, f.get_slice(name))
    filler.check_complete()
    return filler.counter.bytes

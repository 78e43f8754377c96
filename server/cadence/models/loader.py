"""Loads *.safetensors checkpoints (single file or sharded with an index) straight into
a model's parameters, through each parameter's `weight_loader`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Fills every parameter of `model`; raises if a parameter is left unloaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # safe_open is not a mapping
                if "rotary_emb.inv_freq" in name:
                    continue
                target, shard_id = name, None
                for ckpt, (ours, sid) in packed.items():
                    if f".{ckpt}." in name:
                        target, shard_id = name.replace(f".{ckpt}.", f".{ours}."), sid
                        break
                param = params.get(target)
                if param is None:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                loader = getattr(param, "weight_loader", None)
                with torch.no_grad():
                    if loader is None:
                        param.data.copy_(f.get_tensor(name))
                    else:
                        loader(param, f.get_slice(name), shard_id)
                loaded.add(target)
    missing = [n for n in params if n not in loaded and not _tied(model, n, loaded)]
    if missing:
        raise KeyError(f"weights missing from the checkpoint: {missing[:8]}")


def _tied(model: nn.Module, name: str, loaded: set[str]) -> bool:
    """A tied LM head shares the embedding's storage, so loading one loads both."""
    cfg = getattr(model, "config", None)
    return (
        name == "lm_head.weight"
        and bool(getattr(cfg, "tie_word_embeddings", False))
        and "model.embed_tokens.weight" in loaded
    )

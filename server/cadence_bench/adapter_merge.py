"""A LoRA adapter merged into a copy of its base model (`cadence bench merge-adapter`):
each adapted weight becomes W + scaling·B·A, everything else is copied as it is. The
copy serves like any checkpoint: the way one fine-tune per deployment is served, which
E5 measures LoRA serving against.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cadence_bench.adapter_maker import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, weight_files

MERGED_WEIGHTS = "model.safetensors"
_A, _B = ".lora_A.weight", ".lora_B.weight"


def lora_updates(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The adapter's float32 update scaling·B·A by the base checkpoint key it adds to.
    Refuses what this merge does not implement (DoRA, Conv1D layouts, per-module ranks
    or alphas, bias or fully trained modules)."""
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config['peft_type']}, not LORA")
    unsupported = [
        k
        for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save")
        if config.get(k)
    ]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise ValueError(f"{adapter_dir}: {', '.join(unsupported)} not supported by this merge")
    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    updates: dict[str, torch.Tensor] = {}
    for key, a in weights.items():
        if not key.endswith(_A):
            if not key.endswith(_B):
                raise ValueError(f"{adapter_dir}: {key} is not a LoRA A or B matrix")
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(_A)
        b = weights[key.removesuffix(_A) + _B]
        rank = a.shape[0]
        alpha = float(config["lora_alpha"])
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        updates[f"{module}.weight"] = scaling * (b.float() @ a.float())
    return updates


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Writes the merged copy into `out_dir` (one model.safetensors beside the model's
    config and tokenizer files); returns it."""
    model, out = Path(model_dir), Path(out_dir)
    updates = lora_updates(Path(adapter_dir))
    out.mkdir(parents=True, exist_ok=True)
    merged: dict[str, torch.Tensor] = {}
    for file in weight_files(model):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                weight = f.get_tensor(key)
                update = updates.pop(key, None)
                if update is not None:
                    weight = (weight.float() + update).to(weight.dtype)
                merged[key] = weight
    if updates:
        raise ValueError(f"the model has no weight {', '.join(sorted(updates)[:3])} to merge into")
    save_file(merged, str(out / MERGED_WEIGHTS), metadata={"format": "pt"})
    for extra in model.iterdir():  # config, tokenizer, generation config
        is_weights = extra.suffix == ".safetensors" or extra.name.endswith(
            ".safetensors.index.json"
        )
        if extra.is_file() and not is_weights:
            shutil.copy2(extra, out / extra.name)
    return out

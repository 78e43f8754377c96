"""Random LoRA adapters for a model, in PEFT's folder format, for benchmarks that need
many distinct adapters (`cadence bench make-adapters`).

Each adapter is a folder holding `adapter_config.json` and `adapter_model.safetensors`
with PEFT's key names (`base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]), so PEFT itself, vLLM or cadence load it as a trained one.
A is drawn as PEFT initialises it (uniform in ±1/sqrt(in)); B, which PEFT starts at zero
and training moves, is drawn so that the update scaling·B·A has a set share of the base
weight's Frobenius norm (`relative_scale`): large enough that outputs differ from the
base model's, small enough to be a plausible fine-tune. Every adapter has its own random
stream (seed, index), so any one of them is reproducible alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
DEFAULT_RELATIVE_SCALE = 0.1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Architectures whose projections are Conv1D ([in, out] weights, PEFT's fan_in_fan_out):
# the [out, in] layout written here would not fit them.
CONV1D_MODEL_TYPES = ("gpt2",)


@dataclass(frozen=True, slots=True)
class TargetModule:
    """One linear layer an adapter adapts: its module path in the model (the checkpoint
    key without `.weight`), its shape, and its weight's Frobenius norm."""

    path: str
    out_features: int
    in_features: int
    weight_norm: float


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} has no .safetensors weights: give a float checkpoint folder (for a "
            "GGUF model, its float copy, which `cadence bench accuracy` and E5 make beside it)"
        )
    return files


def _model_type(model_dir: Path) -> str:
    config = model_dir / "config.json"
    return str(json.loads(config.read_text()).get("model_type", "")) if config.exists() else ""


def find_targets(model_dir: Path, targets: tuple[str, ...]) -> list[TargetModule]:
    """The model's 2-D weights whose module name ends in one of `targets`, in checkpoint
    order (layer by layer)."""
    if _model_type(model_dir) in CONV1D_MODEL_TYPES:
        raise ValueError(f"{_model_type(model_dir)} stores Conv1D weights; not supported here")
    found: list[TargetModule] = []
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                module, _, leaf = key.rpartition(".")
                if leaf != "weight" or module.rpartition(".")[2] not in targets:
                    continue
                weight = f.get_tensor(key)
                if weight.dim() != 2:
                    continue
                out_features, in_features = weight.shape
                norm = float(weight.float().norm())
                found.append(TargetModule(module, out_features, in_features, norm))
    missing = set(targets) - {t.path.rpartition(".")[2] for t in found}
    if missing:
        raise ValueError(f"{model_dir} has no linear layer named {', '.join(sorted(missing))}")
    return sorted(found, key=lambda t: _natural_key(t.path))


def _natural_key(path: str) -> tuple[int | str, ...]:
    """`model.layers.10.x` after `model.layers.9.x`."""
    return tuple(int(p) if p.isdigit() else p for p in path.split("."))


def adapter_config(
    rank: int, alpha: float, targets: tuple[str, ...], base_model: str
) -> dict[str, object]:
    """PEFT's LoraConfig fields for a plain LoRA adapter (the ones PEFT has written in
    every version; it fills the rest with their defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def b_std(module: TargetModule, rank: int, scaling: float, relative_scale: float) -> float:
    """The standard deviation of B's entries that makes E‖scaling·B·A‖_F equal
    `relative_scale`·‖W‖_F with A ~ U(±1/sqrt(in)) (variance 1/(3 in)):
    E‖BA‖_F² = out·in·r·σ_B²·σ_A² = out·r·σ_B²/3."""
    return (
        relative_scale * module.weight_norm / (scaling * math.sqrt(module.out_features * rank / 3))
    )


def adapter_tensors(
    modules: list[TargetModule],
    rank: int,
    scaling: float,
    relative_scale: float,
    rng: np.random.Generator,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for m in modules:
        bound = 1.0 / math.sqrt(m.in_features)
        a = rng.random((rank, m.in_features), dtype=np.float32) * (2 * bound) - bound
        b = rng.standard_normal((m.out_features, rank), dtype=np.float32)
        b *= b_std(m, rank, scaling, relative_scale)
        tensors[f"{PEFT_PREFIX}{m.path}.lora_A.weight"] = torch.from_numpy(a).to(dtype)
        tensors[f"{PEFT_PREFIX}{m.path}.lora_B.weight"] = torch.from_numpy(b).to(dtype)
    return tensors


def adapter_names(count: int) -> list[str]:
    """adapter-0000, adapter-0001, ...: fixed width, so name order is index order."""
    width = max(4, len(str(count - 1)))
    return [f"adapter-{i:0{width}d}" for i in range(count)]


def make_adapters(
    model_dir: str | Path,
    count: int,
    out_dir: str | Path,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    alpha: float = 16.0,
    seed: int = 0,
    dtype: str = "bfloat16",
    relative_scale: float = DEFAULT_RELATIVE_SCALE,
) -> list[Path]:
    """Writes `count` adapter folders under `out_dir`; returns them in index order."""
    if count < 1 or rank < 1:
        raise ValueError("need at least one adapter of rank at least 1")
    model = Path(model_dir)
    modules = find_targets(model, targets)
    config = json.dumps(adapter_config(rank, alpha, targets, str(model.resolve())), indent=2)
    scaling = alpha / rank
    folders = []
    for index, name in enumerate(adapter_names(count)):
        folder = Path(out_dir) / name
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, index])
        tensors = adapter_tensors(modules, rank, scaling, relative_scale, rng, DTYPES[dtype])
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(config + "\n")
        folders.append(folder)
    return folders

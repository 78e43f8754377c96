"""LoRA adapters for the tests, made and applied by PEFT itself (the oracle): a random
adapter for a tiny model folder, the PeftModel that applies it, PEFT's own delta weight per
module, and the dense delta a parsed `LayerLora` adds to its layer.

peft and transformers are imported where used, so spawned tensor-parallel ranks can
import `dense_delta` without paying for them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from cadence.lora.weights import LayerLora

if TYPE_CHECKING:
    from peft import PeftModel

PREFIX = "base_model.model."


def make_peft_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: float = 16,
    target_modules: list[str] | str,
    use_rslora: bool = False,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    layers_to_transform: list[int] | int | None = None,
    seed: int = 0,
    **extra: Any,
) -> Path:
    """A PEFT LoRA adapter for the model in `model_dir`, A and B both random (non-zero
    deltas), saved by PEFT into `out_dir`; `extra`: more LoraConfig fields."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        layers_to_transform=layers_to_transform,
        init_lora_weights=False,
        **extra,
    )
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


def peft_model(model_dir: Path, adapter_dir: Path) -> PeftModel:
    """The base model in `model_dir` with the adapter applied by PEFT (float32, eval)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_deltas(model: PeftModel, adapter: str = "default") -> dict[str, torch.Tensor]:
    """PEFT's delta weight of every LoRA module, keyed by its transformers module path, in
    nn.Linear orientation [out, in] (a Conv1D's `fan_in_fan_out` delta transposed back)."""
    deltas = {}
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if lora_a is None or adapter not in lora_a:
            continue
        with torch.no_grad():
            delta = module.get_delta_weight(adapter).float()
        deltas[name.removeprefix(PREFIX)] = delta.T if module.fan_in_fan_out else delta
    return deltas


def dense_delta(lora: LayerLora, out_features: int) -> torch.Tensor:
    """What `lora` adds to its layer's weight on this rank: [local out, local in], float32."""
    a = lora.a.float()
    delta = torch.zeros(out_features, a.shape[1])
    for piece in lora.pieces:
        r, width = piece.b_t.shape
        rows = a[piece.rank_start : piece.rank_start + r]
        delta[piece.out_offset : piece.out_offset + width] += piece.b_t.float().T @ rows
    return delta

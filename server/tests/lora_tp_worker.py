"""One tensor-parallel rank of the LoRA parsing tests (spawned by test_lora_peft.py): joins
a gloo group, builds each case's base model and the model with the adapter merged by PEFT
(both sliced by the rank's loaders), parses the adapter for the base model, and records
per adapted layer the delta its slices add and the merged weight's difference to the
base weight on this rank.

Free of transformers and peft imports at module level, so a spawned rank starts fast."""

from __future__ import annotations

from pathlib import Path

import torch
from tp_worker import run_cases

# (case name, base model folder, merged model folder, adapter folder)
Case = tuple[str, str, str, str]


def rank_deltas(case: Case) -> dict[str, dict]:
    from cadence.layers.linear import LinearBase
    from cadence.lora.peft_adapter import load_peft_adapter
    from cadence.models import load_model
    from lora_helpers import dense_delta

    name, base_dir, merged_dir, adapter_dir = case
    base = load_model(base_dir, "float32", "cpu")
    merged = dict(load_model(merged_dir, "float32", "cpu").named_modules())
    weights = load_peft_adapter(name, adapter_dir, base, torch.float32)
    linear = {n: m for n, m in base.named_modules() if isinstance(m, LinearBase)}
    return {
        "delta": {
            layer: dense_delta(lora, linear[layer].out_features)
            for layer, lora in weights.layers.items()
        },
        "merged_minus_base": {n: merged[n].weight - m.weight for n, m in linear.items()},
    }


def _rank_deltas(case: Case, rank: int, world_size: int, port: int) -> dict[str, dict]:
    return rank_deltas(case)


def run_group(world_size: int, cases: list[Case], out_dir: Path) -> list[dict]:
    return run_cases(_rank_deltas, world_size, cases, out_dir)

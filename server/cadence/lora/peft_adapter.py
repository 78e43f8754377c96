"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`) parsed
into the `AdapterWeights` this rank applies.

PEFT stores, per adapted module, `base_model.model.<module path>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] (nn.Linear orientation even for GPT-2's Conv1D layers, whose
`fan_in_fan_out` only transposes the merged delta). Each module is resolved to the
cadence layer holding it (`cadence.lora.targets`), checked against the config and the
layer, and sliced as the layer is: a column-parallel layer keeps B's rows of this rank's
outputs (per part of a fused layer), a row-parallel one A's columns of this rank's input
slice with B whole (the deltas then add up in the layer's all-reduce). An adapter is
either parsed whole or refused with an `AdapterError`, never partly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from cadence.lora.peft_config import AdapterConfig, AdapterError, read_adapter_config
from cadence.lora.targets import ModuleMap, ModuleTarget, module_map
from cadence.lora.weights import AdapterWeights, ExpandPiece, LayerLora

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
PREFIX = "base_model.model."
_FACTORS = {".lora_A.weight": "A", ".lora_B.weight": "B"}
# Keys PEFT writes for what cadence does not serve (their config fields are refused
# first; these catch a file whose config does not say so).
_REFUSED_KEYS = {
    ".lora_magnitude_vector": "a DoRA magnitude vector (use_dora)",
    ".lora_B.bias": "a bias on LoRA's B (lora_bias)",
    ".lora_embedding_A": "LoRA on an embedding (target_modules)",
    ".lora_embedding_B": "LoRA on an embedding (target_modules)",
    # PEFT saves an embedding's or LM head's own weights when LoRA targets it
    ".base_layer.weight": "LoRA on an embedding or the LM head (target_modules)",
}


@dataclass(frozen=True, slots=True)
class _Module:
    """One PEFT module's factors, checked against its cadence layer."""

    target: ModuleTarget
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def load_peft_adapter(
    name: str, path: str | Path, model: nn.Module, dtype: torch.dtype
) -> AdapterWeights:
    """Parses the adapter folder `path` for `model` (as built on this rank): this rank's
    slices in `dtype`, the scaling folded into B. AdapterError names what cannot be
    served and why."""
    folder = Path(path)
    try:
        config = read_adapter_config(folder)
        modules = _resolve(config, read_factors(folder), _module_map(model))
    except AdapterError as e:
        raise AdapterError(f"adapter {name!r} ({folder}): {e}") from None
    by_layer: dict[str, list[_Module]] = defaultdict(list)
    for module in modules:
        by_layer[module.target.layer_name].append(module)
    return AdapterWeights(
        name=name,
        path=str(folder),
        layers={layer: _layer_lora(group, dtype) for layer, group in by_layer.items()},
        max_rank=max(m.rank for m in modules),
        target_modules=tuple(sorted({m.target.module.rsplit(".", 1)[-1] for m in modules})),
    )


def read_factors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT module path -> {"A": lora_A, "B": lora_B}, every key of the file accounted
    for; AdapterError for a key that is no LoRA factor or a module missing one."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        if (folder / PICKLE_FILE).is_file():
            raise AdapterError(
                f"{PICKLE_FILE} is a pickle, which cadence does not load (unpickling can "
                f"run code); save the adapter as {WEIGHTS_FILE} (safe_serialization=True)"
            )
        raise AdapterError(f"no {WEIGHTS_FILE} in {folder}")
    factors: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())  # safe_open is not a mapping
            _refuse_unsupported(keys)
            for key in keys:
                module, factor = _split_key(key)
                factors[module][factor] = f.get_tensor(key)
    except SafetensorError as e:
        raise AdapterError(f"{path}: unreadable ({e})") from None
    if not factors:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    for module, pair in factors.items():
        for factor in ("A", "B"):
            if factor not in pair:
                raise AdapterError(f"{module}: lora_{factor}.weight is missing")
    return dict(factors)


def _refuse_unsupported(keys: list[str]) -> None:
    """Says what a key of an unsupported feature is for, before any other key's complaint
    (the most telling first: an embedding's LoRA factors before its saved base weights)."""
    for suffix, why in _REFUSED_KEYS.items():
        for key in keys:
            if key.endswith(suffix):
                raise AdapterError(f"{key}: {why} is not supported")


def _split_key(key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (module, "A")."""
    for suffix, factor in _FACTORS.items():
        if key.startswith(PREFIX) and key.endswith(suffix):
            return key[len(PREFIX) : -len(suffix)], factor
    raise AdapterError(f"{key}: maps to no LoRA factor (lora_A.weight / lora_B.weight)")


def _module_map(model: nn.Module) -> ModuleMap:
    try:
        return module_map(model)
    except ValueError as e:
        raise AdapterError(str(e)) from None


def _resolve(
    config: AdapterConfig, factors: dict[str, dict[str, torch.Tensor]], modules: ModuleMap
) -> list[_Module]:
    """Every module of the file checked against the config and its cadence layer."""
    resolved = []
    for name in sorted(factors):
        try:
            target = modules.target(name)
        except ValueError as e:
            raise AdapterError(f"target_modules: {e}") from None
        if not config.targets(name):
            raise AdapterError(
                f"{name} has LoRA weights but target_modules={config.target_modules!r} "
                "(with exclude_modules / layers_to_transform) does not select it"
            )
        a, b = factors[name]["A"], factors[name]["B"]
        _check_shapes(name, a, b, target, config.rank(name))
        resolved.append(_Module(target, a, b, config.scaling(name)))
    for name in modules.names():
        if config.targets(name) and name not in factors:
            raise AdapterError(f"{name}: selected by target_modules but has no LoRA weights")
    return resolved


def _check_shapes(
    name: str, a: torch.Tensor, b: torch.Tensor, target: ModuleTarget, rank: int
) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} not 2-D")
    if a.shape[0] != b.shape[1]:
        raise AdapterError(f"{name}: lora_A has rank {a.shape[0]} but lora_B rank {b.shape[1]} (r)")
    if a.shape[0] != rank:
        raise AdapterError(
            f"{name}: its weights have rank {a.shape[0]}, the config says r={rank} "
            "(r / rank_pattern)"
        )
    expected_a, expected_b = (rank, target.in_features), (target.out_features, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise AdapterError(
            f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
            f"layer (expected {expected_a} / {expected_b}: {target.in_features} inputs, "
            f"{target.out_features} outputs)"
        )


def _layer_lora(modules: list[_Module], dtype: torch.dtype) -> LayerLora:
    """The modules of one cadence layer on this rank: A rows stacked in the layer's part
    order (q, k, v; gate, up), one ExpandPiece per part each module's B fills."""
    a_rows: list[torch.Tensor] = []
    pieces: list[ExpandPiece] = []
    rank_start = 0
    for module in sorted(modules, key=lambda m: m.target.order):
        layer = module.target.layer
        cols = layer.part(module.target.slots[0].shard_id).cols  # row-parallel: input slice
        a = module.a if cols is None else module.a[:, cols[0] : cols[0] + cols[1]]
        a_rows.append(a.to(torch.float32))
        for slot in module.target.slots:
            part = layer.part(slot.shard_id)
            start, count = (0, slot.rows) if part.rows is None else part.rows
            b = module.b[slot.first_row + start : slot.first_row + start + count]
            b_t = (b.to(torch.float32) * module.scaling).T.to(dtype).contiguous()
            pieces.append(ExpandPiece(out_offset=part.offset, rank_start=rank_start, b_t=b_t))
        rank_start += module.rank
    return LayerLora(a=torch.cat(a_rows).to(dtype).contiguous(), pieces=tuple(pieces))


__all__ = ["AdapterError", "load_peft_adapter", "read_factors"]

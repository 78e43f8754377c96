"""A PEFT LoRA adapter's `adapter_config.json`: the settings cadence can serve, and PEFT's
rules for which modules the adapter targets and with which rank and alpha.

The matching reproduces PEFT's (`check_target_module_exists`, `get_pattern_key`): module
names are the transformers model's (`model.layers.3.self_attn.q_proj`); a string
`target_modules` is a regular expression the whole name must match; a list entry matches
the whole name or its last dotted components, and only a suffix match is filtered by
`layers_to_transform`; `rank_pattern` / `alpha_pattern` keys are regular expressions
matched against the name's end at a dot, the first matching key (in the file's order)
winning.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"

# Settings whose adapter is not `scaling · B A` added to the targeted layers' outputs
# (or that change the model beyond them): refused when set.
_UNSUPPORTED = {
    "use_dora": "DoRA rescales each adapted weight by a trained magnitude vector",
    "lora_bias": "a bias on LoRA's B",
    "modules_to_save": "whole modules replaced by trained copies",
    "target_parameters": "LoRA on parameters rather than modules",
    "trainable_token_indices": "trained embedding rows",
    "layer_replication": "decoder layers repeated into a deeper model",
    "alora_invocation_tokens": "Activated LoRA applies only from its invocation tokens on",
    "use_qalora": "QALoRA pools the input before A",
    "use_bdlora": "block-diagonal LoRA factors",
    "arrow_config": "Arrow routes among adapters per token",
    "kasa_config": "KaSA adds a diagonal between A and B and truncates the base weight",
    "monteclora_config": "MonteCLoRA samples its factors",
}
# init_lora_weights values that alter the base weights when the adapter is created: such
# an adapter only fits the altered base (unless PEFT converted it when saving, which
# rewrites this field to true).
_ALTERED_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterError(ValueError):
    """An adapter cadence cannot serve; the message names what and why."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]  # a regex (whole name) or names / name suffixes
    exclude_modules: str | tuple[str, ...]
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[str, ...]
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]

    def targets(self, module: str) -> bool:
        """Whether PEFT puts a LoRA layer on `module` (a transformers module path)."""
        if _listed(self.exclude_modules, module):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True  # named in full: layers_to_transform does not apply
        if not any(module.endswith(f".{t}") for t in self.target_modules):
            return False
        return self._in_transformed_layer(module)

    def _in_transformed_layer(self, module: str) -> bool:
        wanted = self.layers_to_transform
        if wanted is None or wanted == ():
            return True
        # the first numbered component after a layers_pattern name (or after any name)
        if self.layers_pattern:
            regexes = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in self.layers_pattern]
        else:
            regexes = [r".*?\.[^.]*\.(?P<idx>\d+)\."]
        match = None
        for regex in regexes:
            match = re.match(regex, module)
            if match is not None:
                break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == wanted if isinstance(wanted, int) else index in wanted

    def rank(self, module: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)

    def scaling(self, module: str) -> float:
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        r = self.rank(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _listed(names: str | tuple[str, ...], module: str) -> bool:
    if isinstance(names, str):
        return bool(names) and re.fullmatch(names, module) is not None
    return module in names or any(module.endswith(f".{n}") for n in names)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """The first key of `patterns` whose regex matches the end of `module` at a dot."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def read_adapter_config(folder: Path) -> AdapterConfig:
    """Parses and checks `folder/adapter_config.json`; AdapterError naming the field."""
    path = folder / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"no {CONFIG_FILE} in {folder}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: not a JSON object")
    return parse_adapter_config(raw)


def parse_adapter_config(raw: dict[str, Any]) -> AdapterConfig:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r}: only LORA adapters are served")
    for field, why in _UNSUPPORTED.items():
        if raw.get(field):
            raise AdapterError(f"{field}={raw[field]!r} is not supported ({why})")
    if raw.get("bias", "none") != "none":
        raise AdapterError(
            f"bias={raw['bias']!r} is not supported (trained base-layer biases); only 'none'"
        )
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_ALTERED_BASE):
        raise AdapterError(
            f"init_lora_weights={init!r}: the adapter fits a base model PEFT altered at "
            "init; save it converted (save_pretrained with "
            "path_initial_model_for_weight_conversion) to apply it to the original model"
        )
    r = _positive_int(raw.get("r"), "r")
    targets = raw.get("target_modules")
    if not targets:
        raise AdapterError("target_modules is missing")
    return AdapterConfig(
        r=r,
        lora_alpha=_number(raw.get("lora_alpha", 8), "lora_alpha"),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=_names(targets, "target_modules"),
        exclude_modules=_names(raw.get("exclude_modules") or (), "exclude_modules"),
        layers_to_transform=_layers(raw.get("layers_to_transform")),
        layers_pattern=_names(raw.get("layers_pattern") or (), "layers_pattern", regex=False),
        rank_pattern={
            k: _positive_int(v, f"rank_pattern[{k!r}]")
            for k, v in _mapping(raw, "rank_pattern").items()
        },
        alpha_pattern={
            k: _number(v, f"alpha_pattern[{k!r}]")
            for k, v in _mapping(raw, "alpha_pattern").items()
        },
    )


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterError(f"{field}={value!r}: not a positive integer")
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdapterError(f"{field}={value!r}: not a number")
    return float(value)


def _names(value: Any, field: str, regex: bool = True) -> str | tuple[str, ...]:
    if isinstance(value, str) and regex:
        try:
            re.compile(value)
        except re.error as e:
            raise AdapterError(f"{field}={value!r}: not a regular expression ({e})") from None
        return value
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AdapterError(f"{field}={value!r}: not a list of module names")


def _layers(value: Any) -> int | tuple[int, ...] | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise AdapterError(f"layers_to_transform={value!r}: not a layer index or a list of them")


def _mapping(raw: dict[str, Any], field: str) -> dict[str, Any]:
    value = raw.get(field) or {}
    if not isinstance(value, dict):
        raise AdapterError(f"{field}={value!r}: not a mapping")
    for key in value:
        try:
            re.compile(key)
        except re.error as e:
            raise AdapterError(f"{field} key {key!r}: not a regular expression ({e})") from None
    return value

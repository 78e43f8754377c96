"""vLLM's flags whose values cadence spells differently, and the ones it refuses.

The plain renames (--max-model-len for --max-total-tokens, ...) are aliases on cadence's
own flags; these need their values translated: --lora-modules (space-separated name=path
or JSON items) into --lora-adapters' comma-separated list, --speculative-config (a JSON
object) into the speculative flags. A vLLM flag with no cadence equivalent is refused with
the reason rather than as an unknown argument.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from cadence.config import QUANTIZE_METHODS
from cadence.flags import record

# vLLM flags cadence has no equivalent for, with what to do instead.
REFUSED = {
    "--max-lora-rank": "cadence reads each adapter's rank from its adapter_config.json and "
    "sizes nothing by a largest rank; drop the flag",
    "--swap-space": "cadence sizes the host swap pool in KV blocks: use --preemption swap "
    "with --swap-blocks",
    "--seed": "cadence seeds sampling per request: send `seed` in the request",
    "--ssl-ca-certs": "cadence serves TLS without client certificates; verify clients in "
    "the proxy in front of it",
    "--ssl-cert-reqs": "cadence serves TLS without client certificates; verify clients in "
    "the proxy in front of it",
}


def refused_flag(argv: Sequence[str]) -> str | None:
    """The error for the first vLLM flag in `argv` that cadence refuses, else None."""
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in REFUSED:
            return f"{name} is vLLM's and has no cadence equivalent: {REFUSED[name]}"
    return None


def lora_module(text: str) -> str:
    """One of vLLM's --lora-modules items, name=path or {"name": ..., "path": ...}, as
    cadence's name=path."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
            return f"{item['name']}={item['path']}"
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'{text!r} is not {{"name": ..., "path": ...}}'
            ) from None
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not name=path")
    return text


class LoraModules(argparse.Action):
    """vLLM's --lora-modules NAME=PATH ...: cadence's --lora-adapters, comma-separated."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        record(parser, namespace, self.dest, option_string, ",".join(values))


# --speculative-config's keys, by the cadence setting each one is.
_SPECULATIVE_KEYS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "model": "draft_model_id",
    "quantization": "draft_quantize",
}
_SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft"}


def speculative_settings(text: str) -> dict[str, Any]:
    """vLLM's --speculative-config JSON as cadence's settings: method ngram (with
    prompt_lookup_min/max) or a draft model (method draft_model, or a `model` alone)."""
    try:
        config = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    config = dict(config)
    method = config.pop("method", "draft_model" if "model" in config else None)
    if method not in _SPECULATIVE_METHODS:
        raise argparse.ArgumentTypeError(
            f"method {method!r}: cadence speculates with {sorted(_SPECULATIVE_METHODS)} "
            "(see --speculative)"
        )
    unknown = sorted(set(config) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{unknown} have no cadence equivalent; it takes {sorted(_SPECULATIVE_KEYS)}"
        )
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if key in config and not (isinstance(config[key], int) and config[key] > 0):
            raise argparse.ArgumentTypeError(f"{key} {config[key]!r} is not a positive integer")
    if config.get("quantization", "int8") not in QUANTIZE_METHODS:
        raise argparse.ArgumentTypeError(
            f"quantization {config['quantization']!r}: the draft is quantized at load to "
            f"{list(QUANTIZE_METHODS)}"
        )
    settings = {"speculative": _SPECULATIVE_METHODS[method]}
    return settings | {_SPECULATIVE_KEYS[key]: value for key, value in config.items()}


class SpeculativeConfig(argparse.Action):
    """vLLM's --speculative-config: sets each speculative setting it names, as its own
    flag would (the same value through both is fine, another is an error)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        for dest, value in values.items():
            record(parser, namespace, dest, option_string, value)

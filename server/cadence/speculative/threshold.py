"""The most tokens a step may hold for the router to still add proposals to it
(InfoResponse.speculative_max_step_tokens).

A proposal costs a step's forward one more token; it pays while the forward is bound by
reading the weights (few tokens), and costs more than it is likely to gain once the step
is compute-bound. The benchmark measures where that happens on the machine it runs on and
stores it in `<cache dir>/speculative.json` ({"max_step_tokens": N, ...}); without that
file a device's default applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cadence.model_source import cache_dir

FILE_NAME = "speculative.json"
# a few decoding requests on a CPU; a GPU stays weight-bound far longer
DEFAULTS = {"cpu": 16, "cuda": 256}


def table_path() -> Path:
    return cache_dir() / FILE_NAME


def speculative_threshold(device: torch.device, path: Path | None = None) -> tuple[int, str]:
    """(most tokens per step, where that number came from: "measured <file>" or
    "default (<device type>)")."""
    path = table_path() if path is None else path
    if path.exists():
        measured = json.loads(path.read_text()).get("max_step_tokens")
        if isinstance(measured, int) and measured > 0:
            return measured, f"measured {path}"
    return DEFAULTS.get(device.type, DEFAULTS["cpu"]), f"default ({device.type})"

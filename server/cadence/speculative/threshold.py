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


def speculative_threshold(
    device: torch.device,
    path: Path | None = None,
    *,
    isa: str = "",
    dtype: str = "",
    model: str = "",
) -> tuple[int, str]:
    """(most tokens per step, where that number came from: "measured <file>" or
    "default (<device type>)"). A measurement applies only to what it measured: when the
    file names another device, instruction set, dtype or model (folder name) than the
    ones given, the default applies and the source says why."""
    path = table_path() if path is None else path
    default = DEFAULTS.get(device.type, DEFAULTS["cpu"])
    if not path.exists():
        return default, f"default ({device.type})"
    table = json.loads(path.read_text())
    measured = table.get("max_step_tokens")
    if not (isinstance(measured, int) and measured > 0):
        return default, f"default ({device.type})"
    ours = {"device": device.type, "isa": isa, "dtype": dtype, "model": model}
    other = {k: table[k] for k, v in ours.items() if v and k in table and table[k] != v}
    if other:
        theirs = ", ".join(f"{k} {v}" for k, v in other.items())
        return default, f"default ({device.type}; {path} measured {theirs})"
    return measured, f"measured {path}"

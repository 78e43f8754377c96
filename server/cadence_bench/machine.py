"""The machine a benchmark ran on, and what the server under test runs with: numbers
compare only within one CPU class (AVX2, AVX-512, AVX-512 BF16), so every report says
which it was."""

from __future__ import annotations

import os
from typing import Any

import httpx
from cadence import cpu_isa as isa


def machine() -> dict[str, Any]:
    supported = isa.supported()
    return {
        "cpu": isa.cpu_model(),
        "cpu_isa": supported[0] if supported else "unknown",
        "cores": os.cpu_count(),
    }


def server_kernels(url: str) -> dict[str, Any]:
    """The dtype and kernels a cadence server reports on /info ({} for other servers)."""
    try:
        info = httpx.get(f"{url.rstrip('/')}/info", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    if not isinstance(info, dict) or "kernels" not in info:
        return {}
    return {"dtype": info.get("model_dtype"), "kernels": info["kernels"]}


def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    m = result.get("machine", {})
    out = [("CPU", f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores)")]
    out.append(("CPU instruction set", m.get("cpu_isa", "?")))
    server = result.get("server", {})
    if server:
        kernels = server.get("kernels", {})
        out.append(("Server dtype, kernels", f"{server.get('dtype')}, {kernels.get('isa', '-')}"))
    return out

"""The numbers `vllm bench serve` reports, from per-request timestamps.

TTFT: request sent to first token. ITL: gap between consecutive tokens (every gap of
every request). TPOT: per request, (latency - TTFT) / (output tokens - 1), for requests
with more than one token. E2EL: request sent to last token. Throughputs divide by the
benchmark's wall time. Percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestOutput:
    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def _stats(name: str, values: list[float]) -> dict[str, float]:
    """mean, median, std, p90, p99 in milliseconds (0 when there are no values)."""
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(outputs: list[RequestOutput], duration: float) -> dict[str, float | int]:
    ok = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    result: dict[str, float | int] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    result |= _stats("ttft", [o.ttft for o in ok])
    result |= _stats("tpot", tpot)
    result |= _stats("itl", [x for o in ok for x in o.itl])
    result |= _stats("e2el", [o.latency for o in ok])
    return result

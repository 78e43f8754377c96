"""A fixed workload against TGI's `/generate_stream`: N requests of a given prompt length
and output length, sent at once (or at a given rate), greedy. Records per request the
time to first token, the inter-token latencies and the end-to-end latency from SSE event
arrival times, and the run's throughput."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass(slots=True)
class Workload:
    num_requests: int = 32
    prompt_words: int = 64  # about 1.3 tokens per word with SmolLM2's tokenizer
    max_new_tokens: int = 32
    request_rate: float = 0.0  # requests per second; 0: all at once


@dataclass(slots=True)
class RequestResult:
    ttft: float
    itls: list[float]
    e2e: float
    generated_tokens: int


@dataclass(slots=True)
class RunResult:
    wall: float
    requests: list[RequestResult] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.requests)

    def summary(self) -> dict[str, float]:
        ttft = [r.ttft for r in self.requests]
        itl = [x for r in self.requests for x in r.itls]
        e2e = [r.e2e for r in self.requests]
        return {
            "requests": len(self.requests),
            "output_tok_s": self.output_tokens / self.wall,
            "req_s": len(self.requests) / self.wall,
            "ttft_p50_ms": 1000 * _pct(ttft, 50),
            "ttft_p99_ms": 1000 * _pct(ttft, 99),
            "itl_p50_ms": 1000 * _pct(itl, 50),
            "itl_p99_ms": 1000 * _pct(itl, 99),
            "e2e_p50_s": _pct(e2e, 50),
            "e2e_p99_s": _pct(e2e, 99),
        }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, int(p) - 1))]


def prompts(w: Workload) -> list[str]:
    """Distinct prompts (no shared prefix beyond a few tokens) of about the same length."""
    words = ("river", "stone", "cloud", "market", "lantern", "orchard", "signal", "harbor")
    return [
        f"Note {i}: " + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(w.prompt_words))
        for i in range(w.num_requests)
    ]


async def _one(client: httpx.AsyncClient, prompt: str, max_new_tokens: int) -> RequestResult:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    start = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", "/generate_stream", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
    return RequestResult(
        ttft=times[0] - start,
        itls=[b - a for a, b in zip(times, times[1:], strict=False)],
        e2e=times[-1] - start,
        generated_tokens=len(times),
    )


async def run(url: str, w: Workload) -> RunResult:
    limits = httpx.Limits(max_connections=w.num_requests + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts(w)):
            if w.request_rate > 0 and i:
                await asyncio.sleep(1.0 / w.request_rate)
            tasks.append(asyncio.create_task(_one(client, p, w.max_new_tokens)))
        results = await asyncio.gather(*tasks)
        return RunResult(wall=time.perf_counter() - start, requests=list(results))

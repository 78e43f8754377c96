"""Sends a workload on an arrival schedule under a concurrency cap and collects the
per-request timings; a progress bar counts finished requests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from cadence_bench.arrivals import arrival_gaps
from cadence_bench.beams import send_beam, send_beam_loop
from cadence_bench.client import send, served_model, session
from cadence_bench.datasets import BenchRequest
from cadence_bench.metrics import RequestOutput


@dataclass(slots=True)
class RunConfig:
    url: str
    backend: str = "tgi"
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    model: str | None = None
    seed: int = 0
    progress: bool = True
    # every request's output constrained to this JSON schema (structured outputs)
    json_schema: dict[str, Any] | None = None
    # sent as `Authorization: Bearer` (a server started with keys)
    api_key: str | None = None
    # beam search of this width (0: greedy streamed requests), in the engine ("engine")
    # or by vLLM's loop of one-token requests above it ("loop")
    beam_width: int = 0
    beam_method: str = "engine"


async def run_benchmark(
    cfg: RunConfig, requests: list[BenchRequest]
) -> tuple[list[RequestOutput], float]:
    """The outputs in request order, and the wall time from first send to last token."""
    gaps = arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = cfg.max_concurrency or len(requests)
    cap = asyncio.Semaphore(limit)
    bar = tqdm(total=len(requests), disable=not cfg.progress, unit="req")
    async with session(cfg.url, limit + 4, cfg.api_key) as client:
        model = cfg.model or ""
        if cfg.backend == "openai" and not model:
            model = await served_model(client)

        async def one(req: BenchRequest) -> RequestOutput:
            async with cap:
                if cfg.beam_width > 0 and cfg.beam_method == "loop":
                    out = await send_beam_loop(client, req, cfg.beam_width, cfg.ignore_eos)
                elif cfg.beam_width > 0:
                    out = await send_beam(
                        client, cfg.backend, req, cfg.beam_width, cfg.ignore_eos, model
                    )
                else:
                    out = await send(
                        client, cfg.backend, req, cfg.ignore_eos, model, cfg.json_schema
                    )
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


def warm_up(cfg: RunConfig, request: BenchRequest) -> None:
    """One short request first, so the first measured one doesn't pay for lazy setup."""
    quiet = RunConfig(
        cfg.url,
        cfg.backend,
        model=cfg.model,
        progress=False,
        json_schema=cfg.json_schema,
        api_key=cfg.api_key,
        beam_width=cfg.beam_width,
        beam_method=cfg.beam_method,
    )
    asyncio.run(run_benchmark(quiet, [request]))

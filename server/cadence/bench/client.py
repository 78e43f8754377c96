"""One streaming request against a server, timed per token: TGI's `/generate_stream` or
OpenAI's `/v1/completions` (vLLM, llama.cpp's server, cadence, ...). Greedy, so every
server does the same work on the same workload."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from cadence.bench.datasets import BenchRequest
from cadence.bench.metrics import RequestOutput


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            yield event


def _tgi_body(req: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    parameters: dict[str, Any] = {"max_new_tokens": req.output_len, "details": True}
    if ignore_eos:
        parameters["ignore_eos"] = True
    return {"inputs": req.prompt, "parameters": parameters}


def _openai_body(req: BenchRequest, ignore_eos: bool, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def send(
    client: httpx.AsyncClient,
    backend: str,
    req: BenchRequest,
    ignore_eos: bool,
    model: str = "",
) -> RequestOutput:
    """Never raises: a failure becomes an unsuccessful RequestOutput with the error."""
    out = RequestOutput(success=False, prompt_len=req.prompt_len)
    if backend == "tgi":
        path, body = "/generate_stream", _tgi_body(req, ignore_eos)
    else:
        path, body = "/v1/completions", _openai_body(req, ignore_eos, model)
    start = time.perf_counter()
    times: list[float] = []
    reported: int | None = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for event in _events(r):
                now = time.perf_counter()
                if backend == "tgi":
                    times.append(now)  # one event per token
                    details = event.get("details") or {}
                    reported = details.get("generated_tokens", reported)
                else:
                    if any(c.get("text") for c in event.get("choices", [])):
                        times.append(now)  # a chunk may hold more than one token
                    usage = event.get("usage") or {}
                    reported = usage.get("completion_tokens", reported)
    except (httpx.HTTPError, RuntimeError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    if not times:
        out.error = "no tokens received"
        return out
    out.success = True
    out.ttft = times[0] - start
    out.itl = [b - a for a, b in zip(times, times[1:], strict=False)]
    out.latency = times[-1] - start
    out.output_tokens = reported if reported is not None else len(times)
    return out


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model /v1/models lists (OpenAI servers want a model name)."""
    r = await client.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])

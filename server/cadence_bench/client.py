"""One streaming request against a server, timed per token: TGI's `/generate_stream` or
OpenAI's `/v1/completions` (vLLM, llama.cpp's server, cadence, ...). Greedy, so every
server does the same work on the same workload.

aiohttp, as vLLM's benchmark uses: the client shares the machine with the server it
measures, and reading 32 event streams through httpx cost ~2 s of CPU over the charter
run (~4 ms per step, taken from the server's two cores)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from cadence_bench.datasets import BenchRequest
from cadence_bench.metrics import RequestOutput

# Largest event line read (a final event carries the whole generated text).
MAX_LINE_BYTES = 1 << 22


def session(url: str, connections: int, api_key: str | None = None) -> aiohttp.ClientSession:
    """A client for `url` (scheme, host, port) with this many connections, sending
    `api_key` as a bearer token when given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return aiohttp.ClientSession(
        base_url=url,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=3600),
        connector=aiohttp.TCPConnector(limit=connections),
        read_bufsize=MAX_LINE_BYTES,
    )


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for raw in response.content:  # one line at a time
        line = raw.decode()
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            yield event


def _tgi_body(
    req: BenchRequest, ignore_eos: bool, json_schema: dict[str, Any] | None
) -> dict[str, Any]:
    parameters: dict[str, Any] = {"max_new_tokens": req.output_len, "details": True}
    if ignore_eos:
        parameters["ignore_eos"] = True
    if json_schema is not None:
        parameters["grammar"] = {"type": "json", "value": json_schema}
    if req.adapter is not None:
        parameters["adapter_id"] = req.adapter
    return {"inputs": req.prompt, "parameters": parameters}


def _openai_body(
    req: BenchRequest, ignore_eos: bool, model: str, json_schema: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model if req.adapter is None else req.adapter,  # vLLM's way to name one
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": json_schema},
        }
    return body


async def _stream(
    client: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    backend: str,
    times: list[float],
) -> int | None:
    """Sends one request and reads its event stream, appending each token event's arrival
    time to `times`; returns the server's count of generated tokens, if it gave one."""
    reported: int | None = None
    async with client.post(path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
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
    return reported


async def send(
    client: aiohttp.ClientSession,
    backend: str,
    req: BenchRequest,
    ignore_eos: bool,
    model: str = "",
    json_schema: dict[str, Any] | None = None,
) -> RequestOutput:
    """Never raises: a failure becomes an unsuccessful RequestOutput with the error.
    `json_schema`: the output is constrained to it (structured outputs)."""
    out = RequestOutput(success=False, prompt_len=req.prompt_len)
    if backend == "tgi":
        path, body = "/generate_stream", _tgi_body(req, ignore_eos, json_schema)
    else:
        path, body = "/v1/completions", _openai_body(req, ignore_eos, model, json_schema)
    start = time.perf_counter()
    times: list[float] = []
    reported: int | None = None
    for attempt in (1, 2):
        try:
            reported = await _stream(client, path, body, backend, times)
            break
        except aiohttp.ServerDisconnectedError as err:
            # a pooled keep-alive connection the server had already closed (llama.cpp's
            # server does between requests): once more on a fresh connection, the time
            # lost counted in the request's latency
            if times or attempt == 2:
                out.error = f"{type(err).__name__}: {err}"
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as err:
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


async def served_model(client: aiohttp.ClientSession) -> str:
    """The first model /v1/models lists (OpenAI servers want a model name)."""
    async with client.get("/v1/models") as r:
        r.raise_for_status()
        return str((await r.json())["data"][0]["id"])

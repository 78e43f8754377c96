"""Beam search requests for `cadence bench --beam-width W`: not streamed (a beam search's
best beam is known only at its end), so a request's time to first token is its latency.
TGI's `/generate` with `parameters.num_beams` (cadence's own field) or OpenAI's
`/v1/completions` with vLLM's `use_beam_search` and `n` = W. A request's output tokens
are its best beam's: what its client reads, as a greedy request's would be.
`--beam-method loop` runs the same search the way vLLM does, above the engine
(`send_beam_loop`), against the same server: what that method costs here."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from cadence_bench.datasets import BenchRequest
from cadence_bench.metrics import RequestOutput


def _body(
    req: BenchRequest, backend: str, width: int, ignore_eos: bool, model: str
) -> dict[str, Any]:
    if backend == "tgi":
        parameters: dict[str, Any] = {
            "num_beams": width,
            "max_new_tokens": req.output_len,
            "details": True,
        }
        if ignore_eos:
            parameters["ignore_eos"] = True
        return {"inputs": req.prompt, "parameters": parameters}
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "use_beam_search": True,
        "n": width,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _best_tokens(answer: dict[str, Any], backend: str, width: int) -> int:
    """The best beam's generated tokens (OpenAI: its usage over the beams returned, per beam)."""
    if backend == "tgi":
        return int(answer["details"]["generated_tokens"])
    return int(answer["usage"]["completion_tokens"]) // max(width, 1)


async def send_beam(
    client: aiohttp.ClientSession,
    backend: str,
    req: BenchRequest,
    width: int,
    ignore_eos: bool,
    model: str = "",
) -> RequestOutput:
    """One beam search request; never raises (a failure is an unsuccessful output)."""
    out = RequestOutput(success=False, prompt_len=req.prompt_len)
    path = "/generate" if backend == "tgi" else "/v1/completions"
    start = time.perf_counter()
    try:
        async with client.post(path, json=_body(req, backend, width, ignore_eos, model)) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            answer = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    out.latency = time.perf_counter() - start
    out.ttft = out.latency
    out.output_tokens = _best_tokens(answer, backend, width)
    out.success = out.output_tokens > 0
    return out


async def _next_candidates(
    client: aiohttp.ClientSession, text: str, width: int
) -> list[tuple[str, float, bool]]:
    """One token after `text`: its `2 × width` most likely (text, logprob, special)."""
    parameters = {"max_new_tokens": 1, "top_n_tokens": 2 * width, "details": True}
    async with client.post("/generate", json={"inputs": text, "parameters": parameters}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        details = (await r.json())["details"]
    return [(t["text"], t["logprob"], t["special"]) for t in details["top_tokens"][0]]


async def send_beam_loop(
    client: aiohttp.ClientSession, req: BenchRequest, width: int, ignore_eos: bool
) -> RequestOutput:
    """The same search by vLLM's out-of-engine method (its `beam_search`, above the
    engine): every step, one request per beam for one token and its `2 × width`
    alternatives, ranked in Python, the beams' texts sent again as new prompts (the
    prefix cache spares their recomputation, not their admission). TGI's `/generate`,
    so the server needs `--max-top-n-tokens` ≥ 2 × width."""
    out = RequestOutput(success=False, prompt_len=req.prompt_len)
    start = time.perf_counter()
    beams: list[tuple[str, float]] = [("", 0.0)]
    finished: list[tuple[str, float]] = []
    generated = 0
    try:
        for _ in range(req.output_len):
            rows = await asyncio.gather(
                *(_next_candidates(client, req.prompt + text, width) for text, _ in beams)
            )
            candidates = [
                (text + piece, score + logprob, special)
                for (text, score), row in zip(beams, rows, strict=True)
                for piece, logprob, special in row
            ]
            candidates.sort(key=lambda c: c[1], reverse=True)
            beams = []
            for text, score, special in candidates:
                if special and not ignore_eos:
                    finished.append((text, score))
                elif len(beams) < width:
                    beams.append((text, score))
            generated += 1
            if not beams:
                break
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    out.latency = time.perf_counter() - start
    out.ttft = out.latency
    out.output_tokens = generated
    out.success = generated > 0
    return out

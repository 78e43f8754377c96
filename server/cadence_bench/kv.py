"""KV accounting for E3/E4: the router's /metrics sampled during a run, and what a server
that reserves each request's maximum length contiguously would hold for the same
requests (computed, not measured: cadence only has the paged cache)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {series name: value}, summed over label sets (so
    `cadence_preemptions_total{kind=...}` becomes one total); comments skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a sequence of `tokens` tokens holds in a paged cache (ceil division)."""
    return -(-tokens // block_size)


def largest_fitting_batch(total_blocks: int, prompt_len: int, max_new: int, block_size: int) -> int:
    """How many requests of prompt_len + max_new tokens fit at once, each at full length."""
    return total_blocks // blocks_for(prompt_len + max_new, block_size)


@dataclass(slots=True)
class InFlight:
    """One running request at an instant: its prompt, its max_new_tokens, tokens made."""

    prompt_len: int
    max_new: int
    generated: int


def contiguous_slots(running: list[InFlight]) -> int:
    """Slots a contiguous cache reserves: prompt + max_new_tokens for each request."""
    return sum(r.prompt_len + r.max_new for r in running)


def stored_tokens(running: list[InFlight]) -> int:
    """Tokens whose KV actually exists: prompt + tokens generated so far."""
    return sum(r.prompt_len + r.generated for r in running)


def contiguous_utilization(running: list[InFlight]) -> float:
    """Tokens stored ÷ slots reserved contiguously (0 with nothing running)."""
    slots = contiguous_slots(running)
    return stored_tokens(running) / slots if slots else 0.0


def shared_sampling_blocks(prompt_len: int, gen: int, n: int, block_size: int) -> tuple[int, int]:
    """Blocks one prompt's n samples of `gen` tokens hold at the end: (with sharing, without).

    With sharing the prompt's full blocks are held once; the partial last prompt block
    and the generated tokens are per sample (copy-on-write copies the partial block on
    the first write). Without sharing every sample holds its own prompt."""
    full = prompt_len // block_size
    own = blocks_for(prompt_len + gen, block_size) - full
    return full + n * own, n * blocks_for(prompt_len + gen, block_size)


class MetricsSampler:
    """`with MetricsSampler(url) as s:` polls /metrics every `every` seconds in a thread;
    s.samples is [(perf_counter time, {series: value})]."""

    def __init__(self, url: str, every: float = 0.05) -> None:
        self.url = url
        self.every = every
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                try:
                    r = client.get("/metrics")
                    self.samples.append((time.perf_counter(), parse_metrics(r.text)))
                except httpx.HTTPError:
                    pass
                self._stop.wait(self.every)

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, name: str) -> float:
        return max((s.get(name, 0.0) for _, s in self.samples), default=0.0)


def running_at(
    t: float, start: float, timings: list[tuple[int, int, float, list[float], float]]
) -> list[InFlight]:
    """The requests running at time t, from client-side timings of requests all sent at
    `start`: (prompt_len, max_new, ttft, itl, latency) each. A request counts as running
    from its first token (its prompt is then in the cache) until its last; `generated`
    is the tokens received by t."""
    out: list[InFlight] = []
    for prompt_len, max_new, ttft, itl, latency in timings:
        first, last = start + ttft, start + latency
        if not first <= t < last:
            continue
        made, at = 1, first
        for gap in itl:
            at += gap
            if at > t:
                break
            made += 1
        out.append(InFlight(prompt_len, max_new, made))
    return out

"""The scheduler and the paged KV cache against the launched stack (the tiny random Llama
with SmolLM2's tokenizer, float32: the scheduler is the point, not the model): preemption
under 3x KV over-subscription, prefix caching counted by the shard, chunked prefill next to
running decodes, the bounded queue and /metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import LaunchedServer, launch, stop, the_shard, tiny_model, wait_for

MAX_NEW = 24
BLOCK = 16


def metrics(url: str) -> dict[str, float]:
    """`name{labels}` -> value, labels other than `model` kept in the key."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        out[re.sub(r'model="[^"]*",?', "", key).replace("{}", "")] = float(value)
    return out


# What the constrained load writes: keys the grammar forces (fast-forwarded) and values the
# model picks, so masks, forced chunks and preemption all meet.
NOTE_SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}},
    "required": ["note", "n"],
    "additionalProperties": False,
}


# A greedy answer: its text and every token's logprob. Outputs are batch-invariant
# (docs/determinism.md), so under load, preemption, chunking and prefix hits both must equal
# the unloaded ones bit for bit.
Answer = tuple[str, tuple[float, ...]]


def generate(
    url: str, prompt: str, max_new_tokens: int = MAX_NEW, schema: dict | None = None
) -> Answer:
    parameters: dict = {"max_new_tokens": max_new_tokens, "details": True}
    if schema is not None:
        parameters["grammar"] = {"type": "json", "value": schema}
    body = {"inputs": prompt, "parameters": parameters}
    r = httpx.post(f"{url}/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    answer = r.json()
    return answer["generated_text"], tuple(t["logprob"] for t in answer["details"]["tokens"])


def stream(url: str, prompt: str, max_new_tokens: int) -> tuple[list[float], dict]:
    """Arrival time of every SSE event, and the last event."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    times, last = [], {}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic())
                last = json.loads(line[5:])
    assert "error" not in last, last
    return times, last


def load_prompts() -> list[str]:
    # Short prompts (one block) that grow by two blocks while decoding: admission fits
    # them all, then the decodes run out of blocks.
    return [f"Note {i}: the number {i * 7} is" for i in range(64)]


def prefix_prompts() -> tuple[str, list[str]]:
    system = "You are a careful assistant who answers briefly and precisely. " * 18
    return system, [f"{system}Question {i}: what is {i} plus {i}?" for i in range(16)]


ROOMY_BLOCKS = 1024  # every test's requests at once
TIGHT_BLOCKS = 42  # a third of what the 64 load requests need


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """A roomy cache, no prefix caching, prompt chunks of 256 tokens."""
    server = launch(
        tmp_path_factory.mktemp("ref"),
        *(*tiny_model(tiny_llama_dir, ROOMY_BLOCKS), "--no-prefix-caching"),
        *("--max-prefill-chunk", "256", "--max-input-tokens", "4000"),
        *("--max-total-tokens", "4096"),
    )
    yield server
    assert stop(server) == 0, server.log()


def small_cache(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str, *extra: str
) -> LaunchedServer:
    # 42 blocks of 16 tokens: the 64 requests need 3x that.
    return launch(
        tmp_path_factory.mktemp("small"),
        *(*tiny_model(tiny_llama_dir, TIGHT_BLOCKS), "--max-waiting-requests", "64"),
        *extra,
    )


@pytest.fixture(scope="module")
def tight(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    server = small_cache(tmp_path_factory, tiny_llama_dir)
    yield server
    assert stop(server) == 0, server.log()


@pytest.fixture(scope="module")
def cached(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """Prefix caching on (the default), room for every request's blocks."""
    server = launch(tmp_path_factory.mktemp("cached"), *tiny_model(tiny_llama_dir, ROOMY_BLOCKS))
    yield server
    assert stop(server) == 0, server.log()


# The references below send the 64 load requests at once to the roomy server (no prefix
# caching, room for all: nothing is preempted, chunked or cached), in one batch instead of
# 64 one after another: outputs are batch-invariant (test_determinism probes it), so each
# answer is the one it gets alone.
@pytest.fixture(scope="module")
def unloaded(reference: LaunchedServer) -> list[Answer]:
    """Greedy outputs of the load prompts without KV pressure."""
    return run_load(reference.url)


@pytest.fixture(scope="module")
def unloaded_constrained(reference: LaunchedServer) -> list[Answer]:
    """Greedy outputs of the load prompts under NOTE_SCHEMA without KV pressure."""
    return run_load(reference.url, NOTE_SCHEMA)


def run_load(url: str, schema: dict | None = None) -> list[Answer]:
    with ThreadPoolExecutor(64) as pool:
        return list(pool.map(lambda p: generate(url, p, schema=schema), load_prompts()))


def routed_requests(url: str) -> float:
    """Requests the router has handed to its batching loop: counted on the HTTP side, so
    it moves while the shard is frozen."""
    counts = metrics(url)
    return sum(v for k, v in counts.items() if k.startswith("cadence_replica_requests_total"))


def run_load_at_once(server: LaunchedServer) -> list[Answer]:
    """`run_load`, with every request queued before the first step: the shard is frozen
    until the router holds all 64, so they contend for the blocks on any machine (a fast
    one finishes early requests before the last arrive otherwise)."""
    shard, before = the_shard(server), routed_requests(server.url)
    os.kill(shard, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(64) as pool:
            outputs = pool.map(lambda p: generate(server.url, p), load_prompts())
            wait_for(
                lambda: routed_requests(server.url) - before == len(load_prompts()),
                60,
                "every load request queued",
            )
            os.kill(shard, signal.SIGCONT)
            return list(outputs)
    finally:
        os.kill(shard, signal.SIGCONT)  # a test that failed while it was frozen


def assert_load_survives(
    server: LaunchedServer, unloaded: list[Answer], kind: str, smollm_dir: str
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{smollm_dir}/tokenizer.json")
    info = httpx.get(f"{server.url}/info").json()
    demand = sum(-(-(len(tok.encode(p).ids) + MAX_NEW) // BLOCK) for p in load_prompts())
    assert demand >= 3 * info["num_blocks"], (demand, info["num_blocks"])
    before = metrics(server.url)
    outputs = run_load_at_once(server)
    after = metrics(server.url)
    assert outputs == unloaded
    preempted = after[f'cadence_preemptions_total{{kind="{kind}"}}'] - before.get(
        f'cadence_preemptions_total{{kind="{kind}"}}', 0
    )
    assert preempted > 0, "3x over-subscription must preempt"
    assert after["cadence_kv_blocks_used"] == 0
    assert after["cadence_running_requests"] == 0
    assert after["cadence_queue_waiting_requests"] == 0


def test_64_requests_at_3x_kv_capacity_all_complete_with_unloaded_outputs(
    tight: LaunchedServer, unloaded: list[Answer], smollm_dir: str
) -> None:
    assert_load_survives(tight, unloaded, "recompute", smollm_dir)


def test_constrained_outputs_survive_preemption_and_prefix_caching(
    tight: LaunchedServer, cached: LaunchedServer, unloaded_constrained: list[Answer]
) -> None:
    """Greedy JSON-constrained outputs without KV pressure or prefix caching (the
    reference) equal those of 64 at once at 3x KV capacity (preempting, prefix caching
    on) and those of 64 at once with room for all."""
    before = metrics(tight.url)
    assert run_load(tight.url, NOTE_SCHEMA) == unloaded_constrained
    after = metrics(tight.url)
    assert after['cadence_preemptions_total{kind="recompute"}'] > before.get(
        'cadence_preemptions_total{kind="recompute"}', 0
    )
    assert after["cadence_grammar_fast_forward_tokens_total"] > before.get(
        "cadence_grammar_fast_forward_tokens_total", 0
    )
    assert run_load(cached.url, NOTE_SCHEMA) == unloaded_constrained
    assert all(text.startswith('{"note": "') for text, _ in unloaded_constrained)


def test_synchronous_scheduling_under_3x_kv_capacity_gives_the_same_outputs(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: str,
    unloaded: list[Answer],
    smollm_dir: str,
) -> None:
    """Each step scheduled only once the previous one is applied (`--async-scheduling off`;
    the other servers here schedule ahead, the default): the same 64 requests, preempting
    when the blocks run out, with prefix caching on."""
    server = small_cache(tmp_path_factory, tiny_llama_dir, "--async-scheduling", "off")
    try:
        assert "async_scheduling=false" in server.log()
        assert_load_survives(server, unloaded, "recompute", smollm_dir)
    finally:
        assert stop(server) == 0, server.log()


def test_swap_preemption_gives_the_same_outputs(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: str,
    unloaded: list[Answer],
    smollm_dir: str,
) -> None:
    server = small_cache(tmp_path_factory, tiny_llama_dir, "--preemption", "swap")
    try:
        assert_load_survives(server, unloaded, "swap", smollm_dir)
    finally:
        assert stop(server) == 0, server.log()


def test_a_shared_system_prompt_is_prefilled_once(
    cached: LaunchedServer, reference: LaunchedServer, smollm_dir: str
) -> None:
    from tokenizers import Tokenizer

    system, prompts = prefix_prompts()
    tok = Tokenizer.from_file(f"{smollm_dir}/tokenizer.json")
    ids = [tok.encode(p).ids for p in prompts]
    shared = 0
    while all(len(i) > shared and i[shared] == ids[0][shared] for i in ids):
        shared += 1
    assert shared >= 200
    cached_tokens = (shared // BLOCK) * BLOCK

    def run(url: str) -> tuple[list[str], float, list[int]]:
        before = metrics(url)["cadence_shard_prompt_tokens_computed_total"]
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: stream(url, p, 4)[1], prompts))
        after = metrics(url)["cadence_shard_prompt_tokens_computed_total"]
        texts = [r["generated_text"] for r in results]
        return texts, after - before, [r["details"]["input_length"] for r in results]

    off_texts, off_computed, lengths = run(reference.url)
    assert lengths == [len(i) for i in ids], "the test tokenizes like the router"
    assert off_computed == sum(lengths)
    hits_before = metrics(cached.url)["cadence_prefix_cache_hits_total"]
    on_texts, on_computed, _ = run(cached.url)
    assert on_texts == off_texts
    # The first request computes the shared blocks; the 15 others find them cached.
    assert on_computed == sum(lengths) - 15 * cached_tokens
    hits = metrics(cached.url)["cadence_prefix_cache_hits_total"] - hits_before
    assert hits >= 15 * cached_tokens


def test_a_long_prompt_is_chunked_while_16_requests_keep_decoding(
    reference: LaunchedServer,
) -> None:
    chunk = 256
    decode_tokens = 400  # long enough to outlast the long prompt's prefill on any CPU
    long_prompt = "The history of the river valley, told year by year. " * 180
    with ThreadPoolExecutor(17) as pool:
        decoders = [
            pool.submit(stream, reference.url, f"Count slowly from {i} upward:", decode_tokens)
            for i in range(16)
        ]
        wait_for(
            lambda: metrics(reference.url)["cadence_running_requests"] >= 16,
            300,
            "16 decoders running",
        )
        submitted = time.monotonic()
        long_times, long_last = pool.submit(stream, reference.url, long_prompt, 1).result()
        results = [d.result() for d in decoders]
    prompt_len = long_last["details"]["input_length"]
    assert prompt_len >= 2000
    first_token = long_times[0]
    chunks = -(-prompt_len // chunk)
    for times, last in results:
        assert last["details"]["generated_tokens"] == decode_tokens
        assert times[-1] > first_token, "a decoder finished before the prefill ended"
        during = sum(submitted <= t <= first_token for t in times)
        # One decode per step, and every chunk is a step: a decoder that waited for the
        # whole prompt would get at most one token in this window.
        assert during >= chunks - 2, (during, chunks)


def test_beyond_max_waiting_requests_is_429_overloaded(tight: LaunchedServer) -> None:
    # ~300-token prompts: two fit in the 42-block cache at a time. The shard is frozen
    # while they arrive, so the first step never ends and the queue certainly fills.
    prompt = "Tell me about the harbor and the lanterns near the old market. " * 22
    shard = the_shard(tight)
    os.kill(shard, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(90) as pool:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 1}}
            futures = [
                pool.submit(httpx.post, f"{tight.url}/generate", json=body, timeout=600)
                for _ in range(90)
            ]
            wait_for(lambda: sum(f.done() for f in futures) >= 90 - 64 - 2, 60, "429s")
            os.kill(shard, signal.SIGCONT)
            responses = [f.result() for f in futures]
    finally:
        os.kill(shard, signal.SIGCONT)
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}
    rejected = [r.json() for r in responses if r.status_code == 429]
    assert rejected, "90 at once exceed --max-waiting-requests 64"
    assert all(r["error_type"] == "overloaded" for r in rejected)
    assert metrics(tight.url)["cadence_requests_rejected_total"] >= len(rejected)


def test_metrics_names_every_series_with_the_model_label(tight: LaunchedServer) -> None:
    text = httpx.get(f"{tight.url}/metrics").text
    for name in (
        "cadence_queue_waiting_requests",
        "cadence_running_requests",
        "cadence_kv_blocks_total",
        "cadence_kv_blocks_used",
        "cadence_kv_blocks_cached",
        "cadence_kv_utilization",
        "cadence_prefix_cache_queries_total",
        "cadence_prefix_cache_hits_total",
        "cadence_preemptions_total",
        "cadence_batch_size_bucket",
        "cadence_batch_tokens_bucket",
        "cadence_queue_time_seconds_bucket",
        "cadence_time_to_first_token_seconds_bucket",
        "cadence_inter_token_latency_seconds_bucket",
        "cadence_e2e_request_latency_seconds_bucket",
        "cadence_prompt_tokens_total",
        "cadence_generation_tokens_total",
        "cadence_shard_computed_tokens_total",
    ):
        assert re.search(rf'^{name}\{{model="[^"]+"', text, re.M), name


def test_cut_streams_release_their_requests_and_blocks_at_once(cached: LaunchedServer) -> None:
    """32 clients stream one shared prompt and hang up after 3 tokens; with nothing else
    to do the server must still retire them: running 0 and no block in use within a second
    (the gauges a gateway reads; they once stayed at the last step's values until another
    request arrived)."""
    prompt = "<|im_start|>user\nTell me a very long story about the sea.<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 200}}

    def cut_after_three_tokens() -> int:
        seen = 0
        with httpx.stream("POST", f"{cached.url}/generate_stream", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen == 3:
                    break  # leaving the block closes the connection
        return seen

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(lambda _: cut_after_three_tokens(), range(32))) == [3] * 32
    wait_for(
        lambda: (
            (now := metrics(cached.url))["cadence_running_requests"] == 0
            and now["cadence_kv_blocks_used"] == 0
        ),
        1.0,
        "running 0 and no KV block used after the cuts",
    )

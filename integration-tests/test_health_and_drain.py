"""Running it like production: `/health` is liveness, `/ready` readiness (a frozen shard
or a wedged forward turns it red, a long prefill does not), SIGTERM drains, a dead shard
stops the launcher with a non-zero code, and `/metrics` carries the gauges gateways read
(docs/deploy.md).

The waits are generous deadlines; the bounds asserted (red within 5 s) keep a margin
over what the rule allows (1 s of Health timeout, plus the stall timeout under load)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import (
    LaunchedServer,
    launch,
    metrics,
    shard_pids,
    stop,
    the_shard,
    tiny_model,
    wait_for,
)

SERVED_NAME = "smollm-under-test"
STALL_TIMEOUT_MS = 300  # the long prefill below takes 4 times longer: /ready must stay green
LONG_PREFILL_MS = 4 * STALL_TIMEOUT_MS
MAX_BATCH_TOKENS = 2048  # the longest prompt one step takes (a few seconds on a slow CPU)
# the tiny random Llama's cache, for the tests about the shard process rather than the model
TINY_BLOCKS = 256


def ready(url: str) -> tuple[int, str]:
    """`/ready`'s status and reason ("" when ready)."""
    response = httpx.get(f"{url}/ready", timeout=10)
    return response.status_code, response.json().get("reason", "")


def alive(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    """Room for a prompt of MAX_BATCH_TOKENS in one step, a short stall timeout (so a long
    prefill is overdue and only the shard's Health answer keeps /ready green)."""
    tmp = tmp_path_factory.mktemp("deploy")
    launched = launch(
        tmp,
        *("--kv-cache-memory", "256MiB", "--served-model-name", SERVED_NAME),
        *("--max-batch-tokens", str(MAX_BATCH_TOKENS)),
        *("--ready-stall-timeout-ms", str(STALL_TIMEOUT_MS)),
    )
    yield launched
    for pid in shard_pids(launched.process):
        os.kill(pid, signal.SIGCONT)  # a test that failed while it was frozen
    code = stop(launched)
    assert code == 0, f"launcher exited with {code} on SIGTERM:\n{launched.log()}"


def test_ready_and_health_are_green_once_launched(server: LaunchedServer) -> None:
    assert ready(server.url) == (200, "")
    response = httpx.get(f"{server.url}/health", timeout=10)
    assert (response.status_code, response.json()) == (200, {})


def test_a_frozen_idle_shard_turns_ready_red_while_health_stays_green(
    server: LaunchedServer,
) -> None:
    shard = the_shard(server)
    os.kill(shard, signal.SIGSTOP)
    try:
        took = wait_for(lambda: ready(server.url)[0] == 503, 15, "/ready red")
        assert took < 5, f"/ready turned red after {took:.1f} s"
        assert ready(server.url) == (503, "shard_silent")
        assert alive(server.url)
    finally:
        os.kill(shard, signal.SIGCONT)
    wait_for(lambda: ready(server.url) == (200, ""), 15, "/ready green after SIGCONT")


def test_a_shard_frozen_mid_stream_is_stalled_and_the_stream_ends_after_sigcont(
    server: LaunchedServer,
) -> None:
    shard = the_shard(server)
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12}}
    body["parameters"] |= {"ignore_eos": True, "details": True}
    events = []
    url = f"{server.url}/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(json.loads(line[5:]))
            if len(events) != 3:
                continue
            os.kill(shard, signal.SIGSTOP)
            try:
                # Red once the step is overdue (1 s) and Health is silent (1 s more).
                took = wait_for(lambda: ready(server.url)[1] == "stalled", 15, "stalled")
                assert took < 5, f"/ready turned red after {took:.1f} s"
                assert alive(server.url)
            finally:
                os.kill(shard, signal.SIGCONT)
    assert len(events) == 12 and "error" not in events[-1], events[-1]
    assert events[-1]["details"]["finish_reason"] == "length"
    wait_for(lambda: ready(server.url) == (200, ""), 15, "/ready green after SIGCONT")


def test_a_long_prefill_on_a_busy_server_keeps_ready_green(server: LaunchedServer) -> None:
    """The long prompt is sized on this machine to take about LONG_PREFILL_MS: from a
    256-token prefill's time, as prefill time grows at least in proportion to the prompt
    (so a fast CPU gets a long prompt, a slow one no needlessly long wait)."""
    client = httpx.Client(base_url=server.url, timeout=300)
    sentence = "The quick brown fox jumps over the lazy dog near the river bank. "
    per_sentence = len(client.post("/tokenize", json={"inputs": sentence}).json())

    def fresh_prompt(tokens: int) -> str:
        """A fresh prefix each time: no prefix-cache hit shortens the prefill."""
        return uuid.uuid4().hex + " " + sentence * (tokens // per_sentence)

    parameters = {"max_new_tokens": 1, "ignore_eos": True}
    sized = client.post("/generate", json={"inputs": fresh_prompt(256), "parameters": parameters})
    per_token_ms = int(sized.headers["x-inference-time"]) / 256
    tokens = min(MAX_BATCH_TOKENS - 64, int(LONG_PREFILL_MS / max(per_token_ms, 1e-3)))
    text = fresh_prompt(max(tokens, 256))
    assert len(client.post("/tokenize", json={"inputs": text}).json()) <= MAX_BATCH_TOKENS
    answers: dict[str, httpx.Response] = {}

    def generate(name: str, inputs: str, new_tokens: int) -> None:
        parameters = {"max_new_tokens": new_tokens, "ignore_eos": True}
        answers[name] = client.post("/generate", json={"inputs": inputs, "parameters": parameters})

    busy = threading.Thread(target=generate, args=("busy", "Tell me a story.", 30))
    long = threading.Thread(target=generate, args=("long", text, 2))
    busy.start()
    long.start()
    statuses = []
    while long.is_alive():
        statuses.append(ready(server.url))
        time.sleep(0.2)
    long.join()
    busy.join()
    assert answers["long"].status_code == 200, answers["long"].text
    assert answers["busy"].status_code == 200, answers["busy"].text
    prefill_ms = int(answers["long"].headers["x-inference-time"])
    assert prefill_ms > STALL_TIMEOUT_MS, "the prefill must outlast the stall timeout"
    assert statuses and all(s == (200, "") for s in statuses), statuses


def test_a_wedged_forward_turns_ready_red_while_the_shard_still_answers(
    tmp_path: Path, tiny_llama_dir: str
) -> None:
    """The shard's forward thread blocks for good at its second step (fault injection)
    while its gRPC event loop answers Health: only the heartbeats show it stuck."""
    launched = launch(
        tmp_path,
        *tiny_model(tiny_llama_dir, TINY_BLOCKS),
        *("--shutdown-timeout", "1", "--ready-stall-timeout-ms", str(STALL_TIMEOUT_MS)),
        env=os.environ | {"CADENCE_FAULT_WEDGE_AT_STEP": "2"},
    )
    try:
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}
        request = threading.Thread(
            target=lambda: httpx.post(f"{launched.url}/generate", json=body, timeout=60),
            daemon=True,
        )
        request.start()
        took = wait_for(lambda: ready(launched.url)[0] == 503, 15, "/ready red")
        assert took < 5, f"/ready turned red after {took:.1f} s"
        assert ready(launched.url) == (503, "wedged")
        assert alive(launched.url)
        assert "the forward blocks now" in launched.log()
    finally:
        for pid in shard_pids(launched.process):
            os.kill(pid, signal.SIGKILL)  # its forward thread never ends
        stop(launched)


def test_metrics_carry_the_gateway_gauges_and_the_served_name(server: LaunchedServer) -> None:
    """Scrapes before, during and after a request; during it the shard is frozen after
    the first token, so the request is certainly running when scraped (a fast model
    would otherwise finish between two polls)."""
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    shard = the_shard(server)
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 30, "ignore_eos": True}}
    scrapes = [metrics(server.url)]
    running = []
    url = f"{server.url}/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or running:
                continue
            os.kill(shard, signal.SIGSTOP)
            try:
                running.append(metrics(server.url))
            finally:
                os.kill(shard, signal.SIGCONT)
    scrapes += running + [metrics(server.url)]
    cadence = f'{{model="{SERVED_NAME}"}}'
    vllm = f'{{model_name="{SERVED_NAME}"}}'
    for m in scrapes:
        waiting = m["cadence_queue_waiting_requests" + cadence]
        assert m["vllm:num_requests_waiting" + vllm] == waiting
        assert m["vllm:num_requests_running" + vllm] == m["cadence_running_requests" + cadence]
        total = m["cadence_kv_blocks_total" + cadence]
        usage = m["vllm:kv_cache_usage_perc" + vllm]
        assert usage == pytest.approx(m["cadence_kv_blocks_used" + cadence] / total)
        assert 0.0 <= usage <= 1.0
        info = f'vllm:cache_config_info{{model_name="{SERVED_NAME}",block_size="16",'
        assert m[f'{info}num_gpu_blocks="{int(total)}"}}'] == 1.0
    assert [m["vllm:num_requests_running" + vllm] for m in running] == [1.0]
    assert running[0]["vllm:kv_cache_usage_perc" + vllm] > 0.0


def _stream(url: str, path: str, body: dict, out: list) -> None:
    """Reads a whole SSE answer into `out`: its status, then its `data:` payloads."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        out.append(response.status_code)
        out.extend(line[5:].strip() for line in response.iter_lines() if line.startswith("data:"))


def test_sigterm_drains_the_requests_in_flight_refuses_new_ones_and_exits_0(
    tmp_path: Path, tiny_llama_dir: str
) -> None:
    # A shutdown timeout no slow machine reaches: this test is about requests finishing.
    launched = launch(
        tmp_path,
        *tiny_model(tiny_llama_dir, TINY_BLOCKS),
        *("--served-model-name", "drained", "--shutdown-timeout", "120"),
    )
    # enough that all three are still decoding when the shard is frozen (the tiny model's
    # steps take milliseconds)
    new_tokens = 400
    tgi = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": new_tokens}}
    tgi["parameters"] |= {"ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Tell me a long story."}]}
    chat |= {"max_tokens": new_tokens, "stream": True, "ignore_eos": True}
    tgi_events: list = []
    chat_events: list = []
    whole: dict[str, httpx.Response] = {}

    def generate() -> None:
        whole["answer"] = httpx.post(f"{launched.url}/generate", json=tgi, timeout=120)

    threads = [
        threading.Thread(target=_stream, args=(launched.url, "/generate_stream", tgi, tgi_events)),
        threading.Thread(
            target=_stream, args=(launched.url, "/v1/chat/completions", chat, chat_events)
        ),
        threading.Thread(target=generate),
    ]
    try:
        for thread in threads:
            thread.start()
        # Every request is running (tokens are flowing on both streams) before the signal.
        running = 'cadence_running_requests{model="drained"}'
        wait_for(
            lambda: (
                metrics(launched.url)[running] == 3 and len(tgi_events) > 3 and len(chat_events) > 3
            ),
            120,
            "three requests running",
        )
        # The shard holds them (however fast this machine decodes) while the signal's
        # effects are checked; they resume afterwards, in the drain.
        shard = the_shard(launched)
        os.kill(shard, signal.SIGSTOP)
        try:
            launched.process.send_signal(signal.SIGTERM)
            wait_for(lambda: ready(launched.url) == (503, "draining"), 15, "/ready draining")
            late = httpx.post(f"{launched.url}/generate", json=tgi, timeout=10)
            assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
            assert late.json()["error_type"] == "shutting_down", late.text
            late = httpx.post(f"{launched.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
            assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
            assert late.json()["error"]["type"] == "server_error", late.text
            assert alive(launched.url)
        finally:
            os.kill(shard, signal.SIGCONT)
        for thread in threads:
            thread.join(timeout=120)
        code = launched.process.wait(timeout=300)
    finally:
        stop(launched)
    assert code == 0, launched.log()
    assert "outcome=Drained" in launched.log()
    assert tgi_events[0] == 200 and len(tgi_events) == 1 + new_tokens, tgi_events[-1]
    assert json.loads(tgi_events[-1])["generated_text"] is not None, tgi_events[-1]
    assert chat_events[0] == 200 and chat_events[-1] == "[DONE]", chat_events[-2:]
    chunks = [json.loads(e) for e in chat_events[1:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    answer = whole["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-generated-tokens"] == str(new_tokens)


def test_a_killed_shard_makes_the_launcher_exit_nonzero(
    tmp_path: Path, tiny_llama_dir: str
) -> None:
    launched = launch(tmp_path, *tiny_model(tiny_llama_dir, TINY_BLOCKS))
    try:
        os.kill(the_shard(launched), signal.SIGKILL)
        code = launched.process.wait(timeout=120)
    finally:
        stop(launched)
    assert code != 0, launched.log()
    assert "shard-0 was killed by SIGKILL" in launched.log()

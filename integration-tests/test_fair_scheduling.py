"""Fair scheduling between tenants through `cadence launch` (`--scheduling-policy`):
tenant A keeps many long requests in flight, more than the batch holds, and tenant B
sends a short request now and then. Under `fair` (the Virtual Token Counter) B's time to
first token stays within twice its time on the idle server; under `fcfs` B waits behind
A's queue. Both figures are measured in the same run, on the same server: the test
compares ratios, never seconds."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import LaunchedServer, launch, metrics, stop, tiny_model, wait_for

KEY_A, KEY_B = "sk-tenant-a-0123", "sk-tenant-b-4567"
KEY_FILE = f"{KEY_A} tenant-a 1\n{KEY_B} tenant-b\n"
BATCH = 4
A_IN_FLIGHT = 24  # six batches' worth: A's queue is long under fcfs
A_TOKENS = 96
B_SAMPLES = 5


@pytest.fixture(scope="module", params=["fair", "fcfs"])
def server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: str,
) -> Iterator[tuple[str, LaunchedServer]]:
    tmp: Path = tmp_path_factory.mktemp(f"sched-{request.param}")
    keys = tmp / "keys.txt"
    keys.write_text(KEY_FILE)
    launched = launch(
        tmp,
        *tiny_model(tiny_llama_dir, 512),
        *("--served-model-name", "m", "--api-key-file", str(keys)),
        *("--max-batch-size", str(BATCH)),
        *("--scheduling-policy", request.param),
    )
    yield request.param, launched
    assert stop(launched) == 0, launched.log()


def first_token_time(client: httpx.Client, key: str, max_tokens: int) -> float:
    """Seconds until the first streamed token of a short completion."""
    body = {"model": "m", "prompt": "Hello there", "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise AssertionError("no token streamed")


def b_ttft(client: httpx.Client) -> float:
    """B's median time to first token over a few requests, a little apart."""
    times = []
    for _ in range(B_SAMPLES):
        times.append(first_token_time(client, KEY_B, 4))
        time.sleep(0.05)
    return statistics.median(times)


def keep_a_busy(url: str, stop_event: threading.Event) -> None:
    """One of A's clients: long completions back to back until told to stop."""
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": A_TOKENS}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop_event.is_set():
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 200


def test_a_tenants_backlog_delays_another_tenant_only_under_fcfs(
    server: tuple[str, LaunchedServer],
) -> None:
    policy, launched = server
    with httpx.Client(base_url=launched.url, timeout=600) as client:
        info = client.get("/info", headers={"Authorization": f"Bearer {KEY_B}"}).json()
        assert info["scheduling_policy"] == policy
        first_token_time(client, KEY_B, 4)  # warm the path
        idle = b_ttft(client)
        stop_event = threading.Event()
        threads = [
            threading.Thread(target=keep_a_busy, args=(launched.url, stop_event))
            for _ in range(A_IN_FLIGHT)
        ]
        for t in threads:
            t.start()
        try:
            waiting = "cadence_queue_waiting_requests"
            wait_for(
                lambda: any(
                    k.startswith(waiting) and v >= A_IN_FLIGHT - BATCH - 2
                    for k, v in metrics(launched.url).items()
                ),
                60,
                "A's requests to queue",
            )
            loaded = b_ttft(client)
        finally:
            stop_event.set()
            for t in threads:
                t.join()
    ratio = loaded / idle
    print(f"{policy}: B's TTFT idle {idle * 1000:.1f} ms, under A's load {loaded * 1000:.1f} ms")
    if policy == "fair":
        assert ratio <= 2.0, f"fair: B's TTFT {ratio:.2f}x its idle TTFT"
    else:
        assert ratio > 2.0, f"fcfs: B's TTFT only {ratio:.2f}x its idle TTFT"

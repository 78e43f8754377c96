"""Fair scheduling between tenants through `cadence launch` (`--scheduling-policy`):
tenant A keeps many long requests in flight, more than the batch holds, and tenant B
sends a short request now and then. Under `fair` (the Virtual Token Counter) B waits for
the step in flight and takes a place in the next, beside A's rows: its time to first
token stays within SEPARATES times its time on the idle server. Under `fcfs` B waits
behind A's queue, whole requests of A_TOKENS steps: 20x and more. Both figures are
measured in the same run, on the same server: the test compares ratios, never seconds.
Idle and loaded phases alternate, and each phase is represented by its fastest request,
since other work on a small machine only ever adds time; the median of the rounds'
ratios is compared."""

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
KEY_FILE = f"{KEY_A} tenant-a weight=1\n{KEY_B} tenant-b\n"
BATCH = 4
A_IN_FLIGHT = 8  # two batches' worth: A always has requests waiting
A_TOKENS = 24
ROUNDS = 3  # idle and loaded phases alternate: each round's ratio compares close figures
B_SAMPLES = 4  # per phase
# B is the light tenant: a short prompt (new to the prefix cache each time) and a few
# tokens, where A's requests are long. (VTC counts tokens: a tenant whose requests are
# heavier than A's would rightly wait for A's counter to catch up.)
B_PROMPT = " hello there"
# Between the two regimes: `fair` measured 1.0-2.1x (a Zen 3's 2 cores put it at 2.1x
# once), `fcfs` 19-35x; a bound of 2.0 sat on the edge of the first.
SEPARATES = 5.0


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
    """Seconds until the first streamed token of a completion of a fresh prompt."""
    prompt = f"{time.perf_counter_ns()}{B_PROMPT}"
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise AssertionError("no token streamed")


def b_ttfts(client: httpx.Client) -> list[float]:
    """B's times to first token over a few requests, a little apart."""
    times = []
    for _ in range(B_SAMPLES):
        times.append(first_token_time(client, KEY_B, 4))
        time.sleep(0.02)
    return times


def keep_a_busy(url: str, stop_event: threading.Event) -> None:
    """One of A's clients: long completions back to back until told to stop."""
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": A_TOKENS}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop_event.is_set():
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 200


def b_ttfts_under_a_load(client: httpx.Client, url: str) -> list[float]:
    """B's times to first token while A keeps A_IN_FLIGHT requests in flight (more than
    the batch holds: A always has requests waiting)."""
    stop_event = threading.Event()
    threads = [
        threading.Thread(target=keep_a_busy, args=(url, stop_event)) for _ in range(A_IN_FLIGHT)
    ]
    for t in threads:
        t.start()
    try:
        waiting = "cadence_queue_waiting_requests"
        wait_for(
            lambda: any(
                k.startswith(waiting) and v >= A_IN_FLIGHT - BATCH - 1
                for k, v in metrics(url).items()
            ),
            60,
            "A's requests to queue",
        )
        return b_ttfts(client)
    finally:
        stop_event.set()
        for t in threads:
            t.join()


def ms(phases: list[list[float]]) -> list[list[int]]:
    return [[round(t * 1000) for t in phase] for phase in phases]


def test_a_tenants_backlog_delays_another_tenant_only_under_fcfs(
    server: tuple[str, LaunchedServer],
) -> None:
    policy, launched = server
    ratios, idle, loaded = [], [], []
    with httpx.Client(base_url=launched.url, timeout=600) as client:
        info = client.get("/info", headers={"Authorization": f"Bearer {KEY_B}"}).json()
        assert info["scheduling_policy"] == policy
        first_token_time(client, KEY_B, 4)  # warm the path
        for _ in range(ROUNDS):
            idle.append(b_ttfts(client))
            loaded.append(b_ttfts_under_a_load(client, launched.url))
            # The machine's other work only ever adds time: each phase's fastest request
            # is its least disturbed figure.
            ratios.append(min(loaded[-1]) / min(idle[-1]))
    ratio = statistics.median(ratios)
    print(f"{policy}: B's TTFT idle {ms(idle)} ms, under A's load {ms(loaded)} ms: {ratio:.2f}x")
    if policy == "fair":
        assert ratio <= SEPARATES, f"fair: B's TTFT {ratio:.2f}x its idle TTFT"
    else:
        assert ratio > SEPARATES, f"fcfs: B's TTFT only {ratio:.2f}x its idle TTFT"

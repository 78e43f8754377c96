"""`cadence launch --replicas 2`: two shard groups behind one router. Concurrent requests
spread over both and generate what transformers generates; a replica whose shard is
killed under load takes down only the requests it held (they end with an error, not a
hang), `/ready` stays green, and every later request is served by the other replica."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import (
    NEW_TOKENS,
    LaunchedServer,
    greedy_ids,
    greedy_ids_together,
    launch,
    reference_up_to_eos,
    stop,
    tiny_model,
)

KILL_DEADLINE = 5.0  # seconds for the router to stop sending to a dead replica
# The tiny random Llama (replicas and routing are the point, not the model); its cache is
# split between the replicas.
TINY_BLOCKS = 512
# tokens per streamed request of the kill test: enough that both replicas still hold
# requests when one is killed (a tiny model's step takes milliseconds)
STREAM_TOKENS = 400


@pytest.fixture(scope="module")
def two_replicas(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    tmp = tmp_path_factory.mktemp("replicas")
    server = launch(tmp, "--replicas", "2", *tiny_model(tiny_llama_dir, TINY_BLOCKS))
    yield server
    code = stop(server)
    assert code == 0, f"launcher exited with {code} on SIGTERM:\n{server.log()}"


def replica_series(url: str, name: str) -> dict[str, float]:
    """`name{...,replica="i"} value` from /metrics, by replica."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = re.compile(rf'^{re.escape(name)}{{[^}}]*replica="(\d+)"}} (\S+)$', re.M)
    return {replica: float(value) for replica, value in pattern.findall(text)}


def shard_pid(replica: int) -> int:
    """The shard process of `replica` (rank 0), by the socket in its command line."""
    needle = f"replica-{replica}-shard-0.sock".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and any(arg.endswith(needle) for arg in argv):
                return int(entry.name)
    raise LookupError(f"no shard of replica {replica}")


def test_concurrent_requests_spread_over_both_and_match_transformers(
    two_replicas: LaunchedServer,
    tiny_reference: tuple[list[str], list[list[int]], int],
) -> None:
    texts, expected, eos_id = tiny_reference
    with httpx.Client(base_url=two_replicas.url, timeout=300) as http:
        assert http.get("/info").json()["replicas"] == 2
        ours = greedy_ids_together(http, texts, NEW_TOKENS)
    for text, got, reference in zip(texts, ours, expected, strict=True):
        assert got == reference_up_to_eos(reference, eos_id), text
    routed = replica_series(two_replicas.url, "cadence_replica_requests_total")
    assert set(routed) == {"0", "1"} and all(n > 0 for n in routed.values()), routed
    assert sum(routed.values()) >= len(texts)


def _stream(url: str, index: int, outcomes: list[str]) -> None:
    """One streamed request: "ok" when it ended with its final event, else what failed."""
    body = {
        "inputs": f"Story {index}: once upon a time",
        "parameters": {"max_new_tokens": STREAM_TOKENS},
    }
    try:
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
            if response.status_code != 200:
                outcomes[index] = f"status {response.status_code}"
                return
            last = ""
            for line in response.iter_lines():
                if line.startswith("data:"):
                    last = line
            ended = '"generated_text":"' in last or '"generated_text": "' in last
            outcomes[index] = "ok" if ended else f"cut: {last[:200]}"
    except httpx.HTTPError as err:  # a stream cut mid-way is an error too, not a hang
        outcomes[index] = f"error: {err!r}"


def test_a_killed_replica_fails_only_its_requests_and_the_other_serves_the_rest(
    two_replicas: LaunchedServer,
) -> None:
    url = two_replicas.url
    before = replica_series(url, "cadence_replica_requests_total")
    outcomes = [""] * 8
    threads = [threading.Thread(target=_stream, args=(url, i, outcomes)) for i in range(8)]
    for t in threads:
        t.start()
    # Both replicas hold requests, then replica 1's shard dies.
    deadline = time.monotonic() + 60
    while True:
        running = replica_series(url, "cadence_replica_running_requests")
        if running.get("0", 0) > 0 and running.get("1", 0) > 0:
            break
        assert time.monotonic() < deadline, running
        time.sleep(0.05)
    os.kill(shard_pid(1), signal.SIGKILL)
    killed_at = time.monotonic()
    while replica_series(url, "cadence_replica_ready").get("1") != 0.0:
        assert time.monotonic() - killed_at < KILL_DEADLINE, "replica 1 still gets requests"
        time.sleep(0.1)
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    for t in threads:
        t.join(timeout=180)
        assert not t.is_alive(), "a request hung after its replica died"
    sent_to = replica_series(url, "cadence_replica_requests_total")
    on_replica_1 = sent_to["1"] - before.get("1", 0)
    failed = [o for o in outcomes if o != "ok"]
    assert len(failed) <= on_replica_1, outcomes  # only the dead replica's requests failed
    assert all(o for o in outcomes), "every request ended, in success or an error"
    # Later requests all go to replica 0 and succeed; the launcher keeps serving.
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(6):
            assert len(greedy_ids(http, f"after the crash {i}", 8)) == 8
    after = replica_series(url, "cadence_replica_requests_total")
    assert after["1"] == sent_to["1"] and after["0"] == sent_to["0"] + 6
    assert two_replicas.process.poll() is None
    assert "replica 1 is down, 1 left" in two_replicas.log()

"""A shard killed in the middle of a step, behind a router that talks to two
tensor-parallel shards directly (the launcher would stop everything once a child died):
the step fails with an error that names the dead rank, the request in flight ends with
it instead of hanging, and the requests after it fail the same way. The tiny random Llama
serves: the failure path is the point, not the model; its request asks for more tokens than
the stream can carry before the stopped rank holds the next step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import FLOAT32, free_port

MAX_NEW = 4000


@dataclass
class Stack:
    url: str
    shards: list[subprocess.Popen]
    router: subprocess.Popen
    log: Path


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def stack(tmp_path: Path, tiny_llama_dir: str) -> Iterator[Stack]:
    log, master = tmp_path / "stack.log", str(free_port())
    sockets = [str(tmp_path / f"shard-{rank}.sock") for rank in (0, 1)]
    serve = [sys.executable, "-m", "cadence", "serve", "--model-id", tiny_llama_dir, *FLOAT32]
    shards = [
        _start(
            [
                *serve,
                "--uds-path",
                path,
                "--rank",
                str(rank),
                "--world-size",
                "2",
                "--master-port",
                master,
            ],
            log,
        )  # fmt: skip
        for rank, path in enumerate(sockets)
    ]
    port = free_port()
    router_argv = [sys.executable, "-m", "cadence.router", "--port", str(port)]
    router_argv += ["--shard-uds-path", sockets[0], "--shard-uds-path", sockets[1]]
    router_argv += ["--tokenizer", tiny_llama_dir, "--model-id", "tiny"]
    router = _start([*router_argv, "--kv-cache-bytes", str(64 << 20)], log)
    running = Stack(f"http://127.0.0.1:{port}", shards, router, log)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(running.url):
            assert router.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield running
    finally:
        for proc in (router, *shards):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process does not act on SIGKILL
                proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_shard_killed_mid_step_fails_that_step_naming_its_rank(stack: Stack) -> None:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": MAX_NEW}}
    body["parameters"]["ignore_eos"] = True
    events = []
    with httpx.stream("POST", f"{stack.url}/generate_stream", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(json.loads(line[5:]))
            if len(events) == 3:
                # Rank 0 stops answering, so the next step holds rank 1 in its all-reduce
                # (the pause lets that step reach it; were it still on its way, it would
                # fail the same). Then rank 1 dies: only its stream breaks.
                os.kill(stack.shards[0].pid, signal.SIGSTOP)
                time.sleep(1.0)
                stack.shards[1].kill()
    *tokens, last = events
    assert all("token" in e for e in tokens) and len(tokens) < MAX_NEW
    assert last["error_type"] == "generation", last
    assert last["error"].startswith("generation failed: shard 1: "), last

    # The router keeps answering: later requests fail at once with the dead rank's name.
    later = httpx.post(f"{stack.url}/generate", json=body, timeout=120)
    assert later.status_code == 424 and "shard 1: " in later.json()["error"], later.text
    # Alive, not ready: readiness names the dead rank.
    assert httpx.get(f"{stack.url}/health", timeout=30).status_code == 200
    ready = httpx.get(f"{stack.url}/ready", timeout=30)
    assert ready.status_code == 503 and "shard 1: " in ready.json()["error"], ready.text
    assert stack.router.poll() is None

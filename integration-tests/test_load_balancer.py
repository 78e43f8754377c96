"""Two `cadence launch` replicas behind a real haproxy (its config: haproxy.cfg.in, as
docs/deploy.md describes it): the load spreads over both; a replica whose shard is killed
under load fails its requests in flight with an error a client sees, is taken out of
rotation through /ready, and loses nothing; a replica drained by SIGTERM under load
finishes every request it holds while haproxy sends the new ones to the other.

Every answer is accounted for: complete (the greedy output, equal to the replica's answer to
the prompt alone), an error the client saw, or lost (load.py): no test allows a lost one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from lb import Haproxy, HaproxyMissing, haproxy_binary, start_haproxy, stop_haproxy
from load import COMPLETE, ERROR, Answer, Load, generate

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

MODEL = 'model="HuggingFaceTB/SmolLM2-135M-Instruct"'
SUCCEEDED = f"cadence_requests_succeeded_total{{{MODEL}}}"
RUNNING = f"cadence_running_requests{{{MODEL}}}"
WAITING = f"cadence_queue_waiting_requests{{{MODEL}}}"
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Dear diary,"]
# The tiny random Llama (balancing, failure and drain are the point, not the model), with
# answers long enough that requests are still in flight while the tests act on them.
NEW_TOKENS = 200
CONCURRENCY = 16
TINY_BLOCKS = 512
# Two replicas share the 2 cores of a small test machine: one compute thread each.
ONE_THREAD = os.environ | {"OMP_NUM_THREADS": "1"}
SERVING = ("--served-model-name", "HuggingFaceTB/SmolLM2-135M-Instruct")


@dataclass
class Balanced:
    haproxy: Haproxy
    replicas: dict[str, LaunchedServer]  # by haproxy server name
    expected: dict[str, str]  # prompt → its complete answer
    tmp: Path
    model_dir: str


def _launch_replica(tmp: Path, model_dir: str, port: int | None = None) -> LaunchedServer:
    flags = (*tiny_model(model_dir, TINY_BLOCKS), *SERVING, "--shutdown-timeout", "120")
    return launch(tmp, *flags, env=ONE_THREAD, port=port)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[Balanced]:
    """Replicas `a` and `b` (float32: a batched answer equals the answer alone) behind
    haproxy, and the answer to each prompt alone."""
    try:
        haproxy_binary()
    except HaproxyMissing as missing:
        pytest.fail(str(missing))  # a skipped test would prove nothing
    tmp = tmp_path_factory.mktemp("balanced")
    replicas: dict[str, LaunchedServer] = {}
    haproxy = None
    try:
        with ThreadPoolExecutor(2) as pool:
            started = {name: pool.submit(_launch_replica, tmp, tiny_llama_dir) for name in "ab"}
        # Each is kept before any failure is raised, so that the finally stops it.
        replicas |= {name: f.result() for name, f in started.items() if not f.exception()}
        for future in started.values():
            future.result()
        addresses = {name: r.url.removeprefix("http://") for name, r in replicas.items()}
        haproxy = start_haproxy(tmp, addresses)
        expected = {}
        for prompt in PROMPTS:
            alone = generate(replicas["a"].url, prompt, NEW_TOKENS, streamed=False)
            assert alone.outcome == COMPLETE, alone
            expected[prompt] = alone.text
        yield Balanced(haproxy, replicas, expected, tmp, tiny_llama_dir)
    finally:
        if haproxy is not None:
            stop_haproxy(haproxy)
        for replica in replicas.values():
            stop(replica)


@pytest.fixture
def balanced(pair: Balanced) -> Iterator[Balanced]:
    """The pair with both replicas serving and UP in haproxy: one that an earlier test
    killed or drained is launched again on its port, as an orchestrator would restart it."""
    for name, replica in pair.replicas.items():
        if replica.process.poll() is not None:
            port = int(replica.url.rsplit(":", 1)[1])
            pair.replicas[name] = _launch_replica(pair.tmp, pair.model_dir, port)
    servers = pair.haproxy.servers
    wait_for(lambda: all(s["status"] == "UP" for s in servers().values()), 60, "both UP")
    yield pair
    for replica in pair.replicas.values():
        for pid in shard_pids(replica.process):
            os.kill(pid, signal.SIGCONT)  # a test that failed while one was stopped


def _concurrently(url: str, count: int) -> list[Answer]:
    """`count` requests at once, streamed and whole in turn over the prompts."""
    with ThreadPoolExecutor(count) as clients:
        jobs = [
            clients.submit(generate, url, PROMPTS[i % len(PROMPTS)], NEW_TOKENS, i % 2 == 0)
            for i in range(count)
        ]
        return [job.result() for job in jobs]


def _assert_complete(answers: list[Answer], expected: dict[str, str]) -> None:
    for answer in answers:
        assert answer.outcome == COMPLETE, answer
        assert answer.text == expected[answer.prompt], answer


def _requests_sent(haproxy: Haproxy, since: dict[str, int] | None = None) -> dict[str, int]:
    """Requests haproxy sent each replica (since an earlier count)."""
    since = since or {}
    return {name: int(row["stot"]) - since.get(name, 0) for name, row in haproxy.servers().items()}


def _failed(haproxy: Haproxy, since: dict[str, int] | None = None) -> dict[str, int]:
    """Requests each replica failed in haproxy's counters (since an earlier count): errors
    reading its answer, answers it aborted, and 5xx statuses (its own or haproxy's)."""
    since = since or {}
    return {
        name: sum(int(row[field] or 0) for field in ("eresp", "srv_abrt", "hrsp_5xx"))
        - since.get(name, 0)
        for name, row in haproxy.servers().items()
    }


def _held(url: str) -> float:
    """Requests the replica holds: running or waiting for a step."""
    now = metrics(url)
    return now[RUNNING] + now[WAITING]


def test_a_bounded_load_spreads_over_both_replicas(balanced: Balanced) -> None:
    before = {name: metrics(r.url)[SUCCEEDED] for name, r in balanced.replicas.items()}
    sent_before = _requests_sent(balanced.haproxy)
    answers = _concurrently(balanced.haproxy.url, CONCURRENCY)
    _assert_complete(answers, balanced.expected)
    served = {name: sum(a.server == name for a in answers) for name in balanced.replicas}
    counted = {
        name: metrics(r.url)[SUCCEEDED] - before[name] for name, r in balanced.replicas.items()
    }
    assert sum(served.values()) == CONCURRENCY, served
    assert all(count > 0 for count in served.values()), served
    # haproxy's header, its counters and each replica's own count agree.
    assert counted == served
    assert _requests_sent(balanced.haproxy, since=sent_before) == served


def test_a_killed_shard_fails_its_requests_and_haproxy_moves_the_load_over(
    balanced: Balanced,
) -> None:
    haproxy, killed, healthy = balanced.haproxy, balanced.replicas["a"], balanced.replicas["b"]
    failed_before = _failed(haproxy)
    load = Load(haproxy.url, PROMPTS, NEW_TOKENS, CONCURRENCY).start()
    try:
        wait_for(lambda: _held(killed.url) > 0 and _held(healthy.url) > 0, 120, "both busy")
        # Stopped first, so that what `a` holds cannot finish before the kill (its /metrics
        # waits up to 2 s for the stopped shard's counters meanwhile).
        shard = the_shard(killed)
        os.kill(shard, signal.SIGSTOP)
        stopped_at = time.monotonic()
        held = _held(killed.url)
        os.kill(shard, signal.SIGKILL)
        took = wait_for(lambda: not _ready(killed.url), 15, "/ready red after the kill")
        assert took < 5, f"/ready turned red {took:.1f} s after the kill"
        wait_for(lambda: haproxy.status("a") == "DOWN", 30, "haproxy marking `a` DOWN")
        down_at = time.monotonic()
        sent_to_killed = _requests_sent(haproxy)["a"]
        wait_for(lambda: len(load.answers_sent_after(down_at)) >= CONCURRENCY, 120, "later answers")
    finally:
        answers = load.stop()
    code = killed.process.wait(timeout=120)

    assert load.sent == len(answers)  # no client died without recording its answer
    errors = [a for a in answers if a.outcome == ERROR]
    complete = [a for a in answers if a.outcome == COMPLETE]
    lost = [a for a in answers if a.outcome not in (COMPLETE, ERROR)]
    assert not lost, lost
    _assert_complete(complete, balanced.expected)
    # What `a` held when its shard died ended in errors, and nothing else did.
    assert held > 0 and len(errors) >= held, (held, errors)
    log = haproxy.log()[-6000:]
    for error in errors:
        assert stopped_at < error.ended and error.sent < down_at, (error, log)
        if error.server:
            assert error.server == "a", (error, log)
        else:
            # No answer at all, so no X-Served-By: haproxy closed the client's connection
            # when `a`'s stopping router closed the one the request had gone out on. That
            # it was `a`'s: it came between the stop and DOWN, and `b` failed nothing.
            assert error.text.startswith("connection:"), (error, log)
    assert _failed(haproxy, since=failed_before)["b"] == 0, log
    after = [a for a in answers if a.sent > down_at]
    assert after and all(a.outcome == COMPLETE and a.server == "b" for a in after), after
    assert _requests_sent(haproxy)["a"] == sent_to_killed
    assert code == 1, killed.log()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=10).status_code == 200
    except httpx.TransportError:
        return False  # the replica is gone: its launcher exited


def test_sigterm_drains_a_replica_while_haproxy_sends_new_requests_to_the_other(
    balanced: Balanced,
) -> None:
    haproxy, drained, other = balanced.haproxy, balanced.replicas["a"], balanced.replicas["b"]
    done_before = metrics(drained.url)[SUCCEEDED]
    sent_before = _requests_sent(haproxy)

    def both_busy_with_everything_dispatched() -> bool:
        """All requests went out, both replicas hold some, and every one haproxy gave `a`
        is there (held or done): none is still on its way to `a` when it drains."""
        sent = _requests_sent(haproxy, since=sent_before)
        now = metrics(drained.url)
        at_drained = now[RUNNING] + now[WAITING] + now[SUCCEEDED] - done_before
        return (
            sum(sent.values()) == CONCURRENCY
            and at_drained == sent["a"]
            and now[RUNNING] + now[WAITING] > 0
            and _held(other.url) > 0
        )

    with ThreadPoolExecutor(1) as background:
        first = background.submit(_concurrently, haproxy.url, CONCURRENCY)
        wait_for(both_busy_with_everything_dispatched, 120, "both replicas busy")
        # The drained replica's shard holds its requests (however fast this machine
        # decodes) while the drain is checked; they resume afterwards.
        shard = the_shard(drained)
        os.kill(shard, signal.SIGSTOP)
        try:
            drained.process.send_signal(signal.SIGTERM)
            wait_for(lambda: haproxy.status("a") == "DOWN", 30, "haproxy marking `a` DOWN")
            assert drained.process.poll() is None, "the drain ended before haproxy saw it"
            sent_to_drained = _requests_sent(haproxy, since=sent_before)["a"]
            later = _concurrently(haproxy.url, CONCURRENCY // 2)
        finally:
            os.kill(shard, signal.SIGCONT)
        answers = first.result()
    code = drained.process.wait(timeout=300)

    _assert_complete(answers, balanced.expected)  # no request in flight was cut
    assert sum(a.server == "a" for a in answers) == sent_to_drained > 0
    _assert_complete(later, balanced.expected)
    assert all(a.server == "b" for a in later), later
    assert _requests_sent(haproxy, since=sent_before)["a"] == sent_to_drained
    assert code == 0, drained.log()
    assert "outcome=Drained" in drained.log()

"""Generation requests through a load balancer, each classified by how it ended: complete
(its full output), an error the client saw (an HTTP error status, an SSE error event, a
stream cut short by the connection), or lost (a timeout, a stream that ended cleanly without
its last event, a 200 short of its tokens): the outcome a client cannot tell from success
or cannot tell at all."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass

import httpx

COMPLETE, ERROR, LOST = "complete", "error", "lost"
# Far above any request's time here: only a hang reaches it.
CLIENT_TIMEOUT = 120.0


@dataclass
class Answer:
    prompt: str
    streamed: bool
    sent: float  # time.monotonic() when sent
    ended: float
    server: str  # the replica the balancer named (X-Served-By), "" when none
    outcome: str  # COMPLETE, ERROR or LOST
    text: str  # the generated text when complete, else what went wrong


def body(prompt: str, new_tokens: int) -> dict:
    """Greedy, exactly `new_tokens` tokens: a complete answer is known in advance."""
    parameters = {"max_new_tokens": new_tokens, "ignore_eos": True, "details": True}
    return {"inputs": prompt, "parameters": parameters}


def generate(url: str, prompt: str, new_tokens: int, streamed: bool) -> Answer:
    sent = time.monotonic()
    server, outcome, text = "", LOST, ""
    try:
        if streamed:
            server, outcome, text = _stream(url, prompt, new_tokens)
        else:
            server, outcome, text = _whole(url, prompt, new_tokens)
    except httpx.TimeoutException as err:
        text = f"no answer within {CLIENT_TIMEOUT} s: {err!r}"
    except httpx.TransportError as err:
        # The connection broke: a stream cut short, or an answer never started.
        outcome, text = ERROR, f"connection: {err!r}"
    return Answer(prompt, streamed, sent, time.monotonic(), server, outcome, text)


def _whole(url: str, prompt: str, new_tokens: int) -> tuple[str, str, str]:
    response = httpx.post(f"{url}/generate", json=body(prompt, new_tokens), timeout=CLIENT_TIMEOUT)
    server = response.headers.get("x-served-by", "")
    if response.status_code != 200:
        return server, ERROR, f"HTTP {response.status_code}: {response.text}"
    generated = response.json()["details"]["generated_tokens"]
    if generated != new_tokens:
        return server, LOST, f"200 with {generated} of {new_tokens} tokens"
    return server, COMPLETE, response.json()["generated_text"]


def _stream(url: str, prompt: str, new_tokens: int) -> tuple[str, str, str]:
    request = body(prompt, new_tokens)
    with httpx.stream(
        "POST", f"{url}/generate_stream", json=request, timeout=CLIENT_TIMEOUT
    ) as response:
        server = response.headers.get("x-served-by", "")
        if response.status_code != 200:
            return server, ERROR, f"HTTP {response.status_code}: {response.read().decode()}"
        tokens = 0
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return server, ERROR, f"error event: {event}"
            tokens += 1
            if event.get("generated_text") is not None:
                if tokens != new_tokens:
                    return server, LOST, f"last event after {tokens} of {new_tokens} tokens"
                return server, COMPLETE, event["generated_text"]
    return server, LOST, f"stream ended cleanly after {tokens} tokens, without its last event"


class Load:
    """`clients` threads sending requests back to back through `url` (streamed and whole in
    turn, over `prompts`), from start() until stop()."""

    def __init__(self, url: str, prompts: list[str], new_tokens: int, clients: int) -> None:
        self.url, self.prompts, self.new_tokens = url, prompts, new_tokens
        self.sent = 0
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Answer]:
        """Sends no more, waits for the requests in flight; every answer."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=CLIENT_TIMEOUT + 30)
        assert not any(t.is_alive() for t in self._threads), "a client outlived its timeout"
        return self.answers

    def answers_sent_after(self, moment: float) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if a.sent > moment]

    def _client(self, index: int) -> None:
        turns = itertools.count(index)
        while not self._stopping.is_set():
            turn = next(turns)
            with self._lock:
                self.sent += 1
            prompt = self.prompts[turn % len(self.prompts)]
            answer = generate(self.url, prompt, self.new_tokens, streamed=turn % 2 == 0)
            with self._lock:
                self.answers.append(answer)

"""The playground at `/`, driven in a real headless browser (the distribution's Chromium,
through Playwright): a prompt typed and sent streams the same answer, with the same token
counts, as the same greedy request through the API, with no console error and no request
to another host; Stop ends the request on the server.

`CADENCE_PLAYGROUND_SCREENSHOT=docs/playground.png` serves the embedded SmolLM2 (in float32) instead
of the tiny random Llama (a readable answer) and saves the page, answered, there."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import SMOLLM_FLOAT32, LaunchedServer, launch, metrics, stop, tiny_model, wait_for

KEY = "playground-key"
PROMPT = "Name three colours of the rainbow."
SEED = 7
SCREENSHOT = os.environ.get("CADENCE_PLAYGROUND_SCREENSHOT")
# The screenshot shows a whole answer; the test proper keeps requests short.
MAX_TOKENS = 80 if SCREENSHOT else 24
CHROMIUM_MISSING = (
    "chromium is not installed: the playground's browser test needs it "
    "(Debian/Ubuntu: apt-get install chromium, as root; `make install` does it)"
)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    # SmolLM2 in float32, as the tests comparing it token for token serve it: in bfloat16
    # a prefix-cache hit may round a near tie the other way.
    model = SMOLLM_FLOAT32 if SCREENSHOT else tiny_model(tiny_llama_dir, 64)
    server = launch(tmp_path_factory.mktemp("playground"), *model, "--api-key", KEY)
    yield server
    assert stop(server) == 0, server.log()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail(CHROMIUM_MISSING)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Debian's browser, not one Playwright would download.
        browser = playwright.chromium.launch(executable_path=chromium)
        yield browser
        browser.close()


def api_answer(server: LaunchedServer) -> dict[str, Any]:
    """The same request as the page's, not streamed, through the API."""
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0,
            "top_p": 1,
            "seed": SEED,
            "max_tokens": MAX_TOKENS,
        },
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompt_streams_the_apis_greedy_answer_and_its_token_counts(
    server: LaunchedServer, browser: Any
) -> None:
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    page.on(
        "console",
        lambda m: errors.append(f"{m.text} ({m.location})") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    requests: list[tuple[str, str, str | None]] = []
    page.on("request", lambda r: requests.append((r.method, r.url, r.post_data)))

    # The page is open to anyone; the key it is given goes with the API request.
    page.goto(f"{server.url}/")
    page.fill("#api_key", KEY)
    page.fill("#temperature", "0")
    page.fill("#top_p", "1")
    page.fill("#seed", str(SEED))
    page.fill("#max_tokens", str(MAX_TOKENS))
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "/^\\d+$/.test(document.getElementById('completion-tokens').value)", timeout=300_000
    )

    expected = api_answer(server)
    shown = page.text_content("#transcript li.assistant .content")
    assert shown == expected["choices"][0]["message"]["content"]
    usage = expected["usage"]
    assert page.text_content("#completion-tokens") == str(usage["completion_tokens"])
    assert page.text_content("#prompt-tokens") == str(usage["prompt_tokens"])
    assert page.text_content("#transcript li.user .content") == PROMPT
    assert "tokens/s" in page.text_content("#speed")
    assert page.text_content("#ttft").endswith(" ms")

    assert errors == []
    assert all(url.startswith(f"{server.url}/") for _, url, _ in requests), requests
    sent = [json.loads(body) for method, url, body in requests if url.endswith("/chat/completions")]
    assert len(sent) == 1 and sent[0]["stream"] is True
    assert sent[0]["stream_options"] == {"include_usage": True}
    if SCREENSHOT:
        page.screenshot(path=str(Path(SCREENSHOT)), full_page=True)
    page.close()


def test_a_json_schema_is_sent_as_response_format_and_a_bad_one_is_not_sent(
    server: LaunchedServer, browser: Any
) -> None:
    page = browser.new_page()
    sent: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: sent.append(json.loads(r.post_data)) if r.method == "POST" else None,
    )
    page.goto(f"{server.url}/")
    page.fill("#api_key", KEY)
    page.fill("#max_tokens", "8")
    page.fill("#json_schema", "{not json")
    page.fill("#prompt", "Answer in JSON.")
    page.press("#prompt", "Enter")
    assert "not valid JSON" in page.text_content("#transcript li.error .content")
    assert sent == []

    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    page.fill("#json_schema", json.dumps(schema))
    page.fill("#prompt", "Answer in JSON.")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "/^\\d+$/.test(document.getElementById('completion-tokens').value)", timeout=300_000
    )
    assert len(sent) == 1
    assert sent[0]["response_format"]["type"] == "json_schema"
    assert sent[0]["response_format"]["json_schema"]["schema"] == schema
    # Constrained to the schema, the answer (cut at 8 tokens) starts as a JSON object.
    assert page.text_content("#transcript li.assistant .content").lstrip().startswith("{")
    page.close()


def test_a_wrong_key_shows_the_servers_error(server: LaunchedServer, browser: Any) -> None:
    page = browser.new_page()
    page.goto(f"{server.url}/")
    page.fill("#api_key", "not-the-key")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    page.wait_for_selector("#transcript li.error")
    assert page.text_content("#transcript li.error .content")
    assert page.get_attribute("#send", "disabled") is None
    page.close()


def test_stop_ends_the_request_on_the_server_and_frees_its_place(
    server: LaunchedServer, browser: Any
) -> None:
    """Stop aborts the stream; the router sees the client go, ends the request at once
    (not after its max_tokens) and frees its slot and blocks."""
    long_answer = 900  # the tiny model never ends early, so the request would run to it
    before = metrics(server.url)
    page = browser.new_page()
    page.goto(f"{server.url}/")
    page.fill("#api_key", KEY)
    page.fill("#max_tokens", str(long_answer))
    page.fill("#prompt", "Tell me a long story.")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "document.querySelector('#transcript li.assistant .content')?.textContent.length > 20",
        timeout=120_000,
    )
    page.click("#stop")
    assert page.get_attribute("#send", "disabled") is None, "the page takes a new prompt"
    wait_for(
        lambda: metrics(server.url)[running_series(before)] == 0,
        30,
        "the stopped request ended on the server",
    )
    after = metrics(server.url)
    generated = sum(v for k, v in after.items() if k.startswith("cadence_generation_tokens_total"))
    generated -= sum(
        v for k, v in before.items() if k.startswith("cadence_generation_tokens_total")
    )
    assert 0 < generated < long_answer, generated
    assert after[blocks_series(after)] == 0, "its KV blocks are free"
    page.close()


def running_series(samples: dict[str, float]) -> str:
    return next(k for k in samples if k.startswith("cadence_running_requests{"))


def blocks_series(samples: dict[str, float]) -> str:
    return next(k for k in samples if k.startswith("cadence_kv_blocks_used{"))

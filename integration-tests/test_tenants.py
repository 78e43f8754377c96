"""Per-key accounting and limits through `cadence launch` with `--api-key-file`: each
tenant's prompt and generated tokens in `/metrics` equal what its requests' answers
report (OpenAI's usage, TGI's details), a key without a name is accounted under its
SHA-256 fingerprint, no key ever shows in `/metrics`, and
`--max-concurrent-requests-per-key` refuses a tenant's extra request with 429 and
`Retry-After` while another tenant is admitted.

The limit test freezes the shard (SIGSTOP) once the first request has its first token,
so that request is certainly in flight when the others arrive."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from text_generation import Client

from conftest import LaunchedServer, launch, metrics, stop, the_shard, tiny_model, wait_for

ALPHA, BETA, BARE = "sk-alpha-0123456789", "sk-beta-9876543210", "sk-bare-5555"
KEY_FILE = f"""# tenants of this test
{ALPHA} team-alpha
{BETA}  team-beta
{BARE}
"""


LONG = 200


def bare_tenant(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """The tiny random Llama: the accounting is the point, not the model."""
    tmp: Path = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.txt"
    keys.write_text(KEY_FILE)
    launched = launch(
        tmp,
        *(*tiny_model(tiny_llama_dir, 256), "--served-model-name", "smollm"),
        *("--api-key-file", str(keys), "--max-concurrent-requests-per-key", "1"),
    )
    yield launched
    assert stop(launched) == 0, launched.log()


def usage_of(url: str) -> dict[str, dict[str, float]]:
    """Each tenant's series by short name (requests, rejected, prompt, generated, running)."""
    names = {
        "cadence_tenant_requests_total": "requests",
        "cadence_tenant_requests_rejected_total": "rejected",
        "cadence_tenant_prompt_tokens_total": "prompt",
        "cadence_tenant_generation_tokens_total": "generated",
        "cadence_tenant_running_requests": "running",
    }
    out: dict[str, dict[str, float]] = {}
    for sample, value in metrics(url).items():
        name, _, labels = sample.partition("{")
        if name in names:
            tenant = labels.split('tenant="')[1].split('"')[0]
            out.setdefault(tenant, {})[names[name]] = value
    return out


def test_each_tenant_is_accounted_the_tokens_its_answers_report(server: LaunchedServer) -> None:
    before = usage_of(server.url)
    assert set(before) == {"team-alpha", "team-beta", bare_tenant(BARE)}
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ALPHA)
    chat = oai.chat.completions.create(
        model="smollm",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=12,
        temperature=0,
    )
    completion = oai.completions.create(
        model="smollm", prompt="One, two, three,", max_tokens=7, n=2, temperature=0.8, seed=3
    )
    tgi = Client(server.url, headers={"Authorization": f"Bearer {BETA}"}, timeout=120)
    generated = tgi.generate("The sky is", max_new_tokens=9, decoder_input_details=True)
    bare = Client(server.url, headers={"Authorization": f"Bearer {BARE}"}, timeout=120)
    streamed = list(bare.generate_stream("Once upon a time", max_new_tokens=5))
    after = usage_of(server.url)

    def grew(tenant: str, series: str) -> float:
        return after[tenant][series] - before[tenant].get(series, 0.0)

    alpha_prompt = chat.usage.prompt_tokens + completion.usage.prompt_tokens
    alpha_generated = chat.usage.completion_tokens + completion.usage.completion_tokens
    assert (grew("team-alpha", "requests"), grew("team-alpha", "prompt")) == (2, alpha_prompt)
    assert grew("team-alpha", "generated") == alpha_generated
    details = generated.details
    assert grew("team-beta", "prompt") == len(details.prefill)
    assert grew("team-beta", "generated") == details.generated_tokens
    assert grew(bare_tenant(BARE), "requests") == 1
    assert grew(bare_tenant(BARE), "generated") == streamed[-1].details.generated_tokens
    assert all(after[t]["running"] == 0.0 for t in after)
    text = httpx.get(f"{server.url}/metrics").text
    assert not any(key in text for key in (ALPHA, BETA, BARE)), "a key is shown"


def test_a_tenant_at_its_limit_gets_429_while_another_is_admitted(
    server: LaunchedServer,
) -> None:
    shard = the_shard(server)
    alpha = {"Authorization": f"Bearer {ALPHA}"}
    beta = {"Authorization": f"Bearer {BETA}"}
    # long enough that the first request is still decoding when its first token arrives
    # here and the shard is frozen (a tiny model's step takes milliseconds)
    body = {"inputs": "Tell me a story.", "parameters": {"max_new_tokens": LONG}}
    body["parameters"] |= {"ignore_eos": True, "details": True}
    before = usage_of(server.url)
    answers: dict[str, httpx.Response] = {}
    other = threading.Thread(
        target=lambda: answers.update(
            beta=httpx.post(f"{server.url}/generate", json=body, headers=beta, timeout=120)
        )
    )
    events = []
    url = f"{server.url}/generate_stream"
    with httpx.stream("POST", url, json=body, headers=alpha, timeout=120) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(json.loads(line[5:]))
            if len(events) > 1:
                continue
            os.kill(shard, signal.SIGSTOP)
            try:
                refused = httpx.post(f"{server.url}/generate", json=body, headers=alpha)
                other.start()
                wait_for(
                    lambda: usage_of(server.url)["team-beta"]["running"] == 1.0,
                    30,
                    "the other tenant admitted",
                )
                during = usage_of(server.url)
            finally:
                os.kill(shard, signal.SIGCONT)
    other.join()
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert "per-key" in refused.json()["error"]
    assert during["team-alpha"]["running"] == 1.0
    assert during["team-alpha"]["rejected"] == before["team-alpha"]["rejected"] + 1
    assert answers["beta"].status_code == 200, answers["beta"].text
    assert len(events) == LONG and events[-1]["details"]["finish_reason"] == "length"
    # Its request ended: the tenant is admitted again.
    again = httpx.post(f"{server.url}/generate", json=body, headers=alpha, timeout=120)
    assert again.status_code == 200, again.text
    assert usage_of(server.url)["team-alpha"]["running"] == 0.0

"""Per-key accounting and limits through `cadence launch` with `--api-key-file`: each
tenant's prompt and generated tokens in `/metrics` equal what its requests' answers
report (OpenAI's usage, TGI's details), a key without a name is accounted under its
SHA-256 fingerprint, no key ever shows in `/metrics`, and
`--max-concurrent-requests-per-key` refuses a tenant's extra request with 429 and
`Retry-After` while another tenant is admitted; the key file is reloaded when it changes
(a removed key refused at once, a new one admitted, its `tokens_per_minute` enforced with
the wait in `Retry-After`) and on SIGHUP to the launcher; `GET /v1/usage` shows a key its
tenant's account and an admin key every one, as `/metrics` counts them, a stopped stream
counted up to where it stopped.

The limit test freezes the shard (SIGSTOP) once the first request has its first token,
so that request is certainly in flight when the others arrive."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
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
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEY_FILE)
    return keys


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str, key_file: Path
) -> Iterator[LaunchedServer]:
    """The tiny random Llama: the accounting is the point, not the model."""
    tmp: Path = tmp_path_factory.mktemp("tenants")
    keys = key_file
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


GAMMA, ADMIN = "sk-gamma-2468", "sk-admin-1357"
GAMMA_TPM = 100  # tokens a minute: the two requests below take about 135
RELOADED_KEY_FILE = f"""{ALPHA} team-alpha
{BARE}
{GAMMA} team-gamma tokens_per_minute={GAMMA_TPM}
{ADMIN} ops role=admin
"""


def status_with(url: str, key: str, max_new_tokens: int = 4) -> httpx.Response:
    body = {"inputs": "Count with me:", "parameters": {"max_new_tokens": max_new_tokens}}
    body["parameters"] |= {"ignore_eos": True, "details": True}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)


def usage_api(url: str, key: str) -> list[dict]:
    answer = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


def test_a_changed_key_file_takes_effect_with_its_token_rate_and_usage_agrees_with_metrics(
    server: LaunchedServer, key_file: Path
) -> None:
    try:
        key_file.write_text(RELOADED_KEY_FILE)
        wait_for(lambda: status_with(server.url, GAMMA).status_code == 200, 30, "new key in")
        # BETA's line is gone: refused at once, whatever its tenant's past.
        assert status_with(server.url, BETA).status_code == 401
        # team-gamma's bucket: ~125 tokens more now, so it owes; the next is refused
        # with the seconds the bucket needs, and another tenant is not.
        assert status_with(server.url, GAMMA, 120).status_code == 200
        refused = status_with(server.url, GAMMA)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) > 1
        assert f"{GAMMA_TPM} tokens per minute" in refused.json()["error"]
        assert status_with(server.url, ALPHA).status_code == 200
        (gamma,) = usage_api(server.url, GAMMA)
        counted = usage_of(server.url)["team-gamma"]
        assert gamma["tenant"] == "team-gamma" and gamma["tokens_per_minute"] == GAMMA_TPM
        assert (gamma["requests"], gamma["rejected_requests"]) == (2, 1)
        assert gamma["prompt_tokens"] == counted["prompt"]
        assert gamma["generation_tokens"] == counted["generated"] == 4 + 120
        assert gamma["tokens_available"] <= 0
        everyone = {t["tenant"]: t for t in usage_api(server.url, ADMIN)}
        assert set(everyone) >= {"team-alpha", "team-beta", "team-gamma", "ops"}
        for tenant, series in usage_of(server.url).items():
            assert everyone[tenant]["requests"] == series["requests"]
            assert everyone[tenant]["generation_tokens"] == series["generated"]
    finally:
        key_file.write_text(KEY_FILE)
        wait_for(lambda: status_with(server.url, BETA).status_code == 200, 30, "keys restored")


def test_sighup_to_the_launcher_reloads_the_keys_and_stops_nothing(
    server: LaunchedServer,
) -> None:
    reloads = server.log().count('why="SIGHUP"')
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: server.log().count('why="SIGHUP"') > reloads, 30, "a reload on SIGHUP")
    assert server.process.poll() is None
    assert status_with(server.url, ALPHA).status_code == 200


def test_a_stopped_stream_is_counted_up_to_where_it_stopped(server: LaunchedServer) -> None:
    tenant = bare_tenant(BARE)
    (before,) = usage_api(server.url, BARE)
    body = {"inputs": "Tell me a story.", "parameters": {"max_new_tokens": LONG}}
    body["parameters"]["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {BARE}"}
    received = 0
    with httpx.stream(
        "POST", f"{server.url}/generate_stream", json=body, headers=headers, timeout=120
    ) as stream:
        for line in stream.iter_lines():
            received += line.startswith("data:")
            if received == 3:
                break  # the client goes away
    wait_for(lambda: usage_of(server.url)[tenant]["running"] == 0.0, 30, "the stream ended")
    (after,) = usage_api(server.url, BARE)
    generated = after["generation_tokens"] - before["generation_tokens"]
    assert 3 <= generated < LONG, generated
    assert after["generation_tokens"] == usage_of(server.url)[tenant]["generated"]


def test_bench_drives_two_tenants_and_each_is_billed_what_it_was_served(
    server: LaunchedServer, tmp_path: Path
) -> None:
    """`cadence bench --tenants`: each tenant's generated tokens as the benchmark counted
    them equal what `/v1/usage` billed it."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        f"- {{name: alpha, api_key: {ALPHA}, num_prompts: 3, max_concurrency: 1}}\n"
        # the server admits one request per key at a time: each tenant keeps to it
        f"- {{name: bare, api_key_env: BARE_KEY, num_prompts: 2, request_rate: 4, "
        "max_concurrency: 1}\n"
    )
    before = {t: usage_api(server.url, key)[0] for t, key in (("alpha", ALPHA), ("bare", BARE))}
    result_file = tmp_path / "result.json"
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence",
            "bench",
            *("--base-url", server.url, "--tenants", str(tenants)),
            *("--input-len", "24", "--output-len", "6:10", "--ignore-eos", "--no-progress"),
            *("--result-file", str(result_file)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"BARE_KEY": BARE},
    )
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "Per tenant" in bench.stdout
    result = json.loads(result_file.read_text())
    assert result["completed"] == 5
    for tenant, key in (("alpha", ALPHA), ("bare", BARE)):
        (after,) = usage_api(server.url, key)
        served = result["tenants"][tenant]
        billed = after["generation_tokens"] - before[tenant]["generation_tokens"]
        assert served["failed"] == 0, served
        # the benchmark's warm-up request (2 tokens) goes out under the first tenant's key
        assert billed == served["total_output_tokens"] + (2 if tenant == "alpha" else 0)

"""The real client libraries, used as their docs show, against `cadence launch` with an
API key: text-generation (TGI's client), huggingface_hub.InferenceClient and openai.
Every response body is also validated against the OpenAPI document the server serves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client

from conftest import LaunchedServer, launch, stop, tiny_model

KEY = "test-key-4"
MODEL = "smollm"  # its --served-model-name: the OpenAI routes answer 404 to any other


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """The tiny random Llama in float32 (SmolLM2's tokenizer and chat template): the
    clients' protocols are the point, not the model. Float32 has one product path, so a
    prefix-cache hit that computes a prompt's last rows in a smaller product cannot flip a
    greedy choice between two equal requests."""
    tmp: Path = tmp_path_factory.mktemp("clients")
    s = launch(
        tmp,
        *tiny_model(tiny_llama_dir, 1024),
        *("--api-key", KEY, "--cors-allow-origin", "*", "--served-model-name", MODEL),
    )
    yield s
    assert stop(s) == 0, s.log()


@pytest.fixture(scope="module")
def oai(server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)


@pytest.fixture(scope="module")
def schema(server: LaunchedServer) -> dict:
    return httpx.get(f"{server.url}/openapi.json").json()


def check(schema: dict, name: str, body: object) -> None:
    """Validates `body` against components.schemas[name] of the served document."""
    root = {"$ref": f"#/components/schemas/{name}", "components": schema["components"]}
    jsonschema.Draft202012Validator(root).validate(body)


def test_without_the_key_generation_is_401_and_health_stays_open(server: LaunchedServer):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/generate", json={"inputs": "hi"})
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()


def test_text_generation_client_generate_details_and_stream(server: LaunchedServer, schema):
    # the client's own default timeout (10 s) is shorter than a loaded 2-core machine may
    # take to answer; the test is about the protocol, not the latency
    client = Client(server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    out = client.generate(
        "The capital of France is", max_new_tokens=8, decoder_input_details=True, top_n_tokens=2
    )
    assert out.details.generated_tokens == len(out.details.tokens) <= 8
    assert out.details.prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in out.details.prefill[1:])
    streamed = "".join(
        r.token.text
        for r in client.generate_stream("The capital of France is", max_new_tokens=8)
        if not r.token.special
    )
    assert streamed == out.generated_text
    # best_of: the other samples come back too, each with its own seed
    best = client.generate("Once upon a time", max_new_tokens=5, best_of=2, do_sample=True)
    others = best.details.best_of_sequences
    assert len(others) == 1 and others[0].seed != best.details.seed
    raw = httpx.post(
        f"{server.url}/generate",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"inputs": "Hi", "parameters": {"max_new_tokens": 3, "details": True}},
        timeout=120,
    )
    check(schema, "GenerateResponse", raw.json())
    for name in ("x-queue-time", "x-inference-time", "x-time-per-token", "x-prompt-tokens"):
        assert name in raw.headers
    assert raw.headers["x-generated-tokens"] == "3"


def test_inference_client_text_generation_and_chat_stream(server: LaunchedServer):
    client = InferenceClient(base_url=server.url, api_key=KEY, timeout=300)
    text = client.text_generation("The capital of France is", max_new_tokens=6)
    assert isinstance(text, str) and text
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat_completion(messages, max_tokens=12, temperature=0)
    chunks = list(client.chat_completion(messages, max_tokens=12, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_openai_completions_with_n_logprobs_echo_and_usage(oai: openai.OpenAI, schema):
    r = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, seed=11, logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1, "n samples with distinct derived seeds"
    again = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, seed=11, logprobs=2
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices], "seeded: reproducible"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    check(schema, "Completion", r.model_dump(exclude_unset=True))
    echo = oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=2, echo=True, logprobs=1, temperature=0
    )
    assert echo.choices[0].text.startswith("Hello there")
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token
    many = oai.completions.create(model=MODEL, prompt=["A", "B"], max_tokens=2, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]


def test_openai_stream_ends_with_done_and_usage(oai: openai.OpenAI, server: LaunchedServer):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        n=2,
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": "Hi", "max_tokens": 2, "stream": True},
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"


def test_openai_chat_parameters_change_the_output_as_defined(oai: openai.OpenAI, schema):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    check(schema, "ChatCompletion", greedy.model_dump(exclude_unset=True))
    first = greedy.choices[0].logprobs.content[0]
    assert first.top_logprobs[0].token == first.token  # greedy takes the most likely
    top1 = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, extra_body={"top_k": 1}, seed=5, top_p=1.0
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    # logit_bias -100 on the greedy first token removes it
    tokenized = httpx.post(
        f"{oai.base_url.scheme}://{oai.base_url.host}:{oai.base_url.port}/tokenize",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"inputs": first.token},
    ).json()
    banned = tokenized[-1]["id"]
    biased = oai.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=8,
        temperature=0,
        logit_bias={str(banned): -100},
        logprobs=True,
    )
    assert biased.choices[0].logprobs.content[0].token != first.token
    # stop cuts at the string
    text = greedy.choices[0].message.content
    cut = text[len(text) // 2 :].strip()[:3]
    if cut:
        stopped = oai.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=8, temperature=0, stop=[cut]
        )
        assert stopped.choices[0].message.content == text[: text.index(cut)]
        assert stopped.choices[0].finish_reason == "stop"
    length = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=2, temperature=0
    )
    assert length.choices[0].finish_reason == "length" and length.usage.completion_tokens == 2


def test_openai_errors_are_400_naming_the_parameter_and_the_server_keeps_serving(
    oai: openai.OpenAI,
):
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        {"temperature": 5},
        {"top_p": 0},
        {"n": 0},
        {"max_tokens": 0},
        {"logit_bias": {"x": 1}},
        {"response_format": {"type": "yaml"}},
        {"top_logprobs": 3},
        {"presence_penalty": 9},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=msgs, **extra)
        assert e.value.body["param"].startswith(next(iter(extra))), e.value.body
    ok = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert ok.choices[0].message.content is not None
    models = oai.models.list()
    assert len(models.data) == 1


def test_sdks_see_a_wrong_model_and_an_unknown_route_as_404s_that_are_logged_and_counted(
    oai: openai.OpenAI, server: LaunchedServer
) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=2)
    assert e.value.body["message"] == "The model `gpt-4o` does not exist."
    with pytest.raises(openai.NotFoundError) as e:
        oai.post("/no-such-route", body={}, cast_to=httpx.Response)
    assert e.value.body["message"] == "Invalid URL (POST /v1/no-such-route)"
    # The browser SDK's preflight, its own headers asked for.
    asked = "authorization,content-type,x-stainless-lang,x-stainless-os,x-stainless-retry-count"
    preflight = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={
            "origin": "https://app.example",
            "access-control-request-method": "POST",
            "access-control-request-headers": asked,
        },
        timeout=10,
    )
    assert preflight.status_code == 200
    assert set(asked.split(",")) <= set(
        preflight.headers["access-control-allow-headers"].split(",")
    )
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert (
        'cadence_http_requests_rejected_total{model="smollm",route="/v1/chat/completions",'
        'status="404",reason="NotFoundError"} 1\n'
    ) in metrics
    rejected = [line for line in server.log().splitlines() if "request rejected" in line]
    assert any("/v1/no-such-route" in line and "404" in line for line in rejected), rejected
    assert not any(KEY in line or "wrong" in line for line in rejected), rejected

"""TGI's /generate, /generate_stream, /health and /info against the launched stack."""

from __future__ import annotations

import json

import httpx


def read_sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            events.append(json.loads(line[len("data:") :].strip()))
    return events


def generate(client: httpx.Client, inputs: str, **parameters) -> dict:
    response = client.post("/generate", json={"inputs": inputs, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()


def test_health_and_info_describe_the_served_model(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    info = client.get("/info").json()
    assert info["model_dtype"] == "float32"
    assert info["block_size"] == 16
    assert info["num_blocks"] > 0
    assert info["max_total_tokens"] > info["max_input_tokens"] > 0
    # float weights: the quantization fields name the float dtype, and metrics say the same
    quant = info["quantization"]
    assert quant["weights"] == "float32" and quant["kv_cache_dtype"]
    metrics = client.get("/metrics").text
    assert 'cadence_quantization_info{model="' in metrics
    assert 'weights="float32"' in metrics


def test_generate_answers_with_the_requested_number_of_tokens(client: httpx.Client) -> None:
    body = generate(client, "The capital of France is", max_new_tokens=8, details=True)
    details = body["details"]
    assert details["finish_reason"] in ("length", "eos_token")
    assert details["generated_tokens"] == len(details["tokens"])
    if details["finish_reason"] == "length":
        assert details["generated_tokens"] == 8
    assert body["generated_text"] == "".join(t["text"] for t in details["tokens"])
    assert all(t["logprob"] <= 0.0 for t in details["tokens"])


def test_stream_events_add_up_to_the_generated_text(client: httpx.Client) -> None:
    payload = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12, "details": True}}
    with client.stream("POST", "/generate_stream", json=payload) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_sse_events(response)
    assert events, "no events"
    for index, event in enumerate(events, start=1):
        assert event["index"] == index
        assert set(event["token"]) >= {"id", "text", "logprob", "special"}
    assert all(event["generated_text"] is None for event in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["generated_tokens"] == len(events)
    blocking = generate(client, "Once upon a time", max_new_tokens=12)
    assert blocking["generated_text"] == last["generated_text"]


def test_stop_string_ends_generation_and_is_not_returned(client: httpx.Client) -> None:
    full = generate(client, "Count: one, two, three,", max_new_tokens=24)["generated_text"]
    # Pick a stop string from the middle of what greedy decoding produces anyway.
    stop = full.strip()[len(full.strip()) // 2 :][:3]
    assert stop, full
    body = generate(client, "Count: one, two, three,", max_new_tokens=24, stop=[stop], details=True)
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert stop not in body["generated_text"]
    assert full.startswith(body["generated_text"])


def test_multibyte_characters_arrive_whole_in_the_stream(client: httpx.Client) -> None:
    payload = {
        "inputs": "Translate to Japanese and add emoji: I love Tokyo 🗼. 日本語:",
        "parameters": {"max_new_tokens": 24, "do_sample": True, "seed": 7, "temperature": 1.5},
    }
    with client.stream("POST", "/generate_stream", json=payload) as response:
        events = read_sse_events(response)
    texts = [e["token"]["text"] for e in events]
    assert all("\ufffd" not in text for text in texts), texts
    assert "".join(texts) == events[-1]["generated_text"]


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    params = {"max_new_tokens": 16, "do_sample": True, "temperature": 1.0, "seed": 1234}
    first = generate(client, "My favourite animal is", **params)
    second = generate(client, "My favourite animal is", **params)
    assert first["generated_text"] == second["generated_text"]


def test_return_full_text_prepends_the_prompt(client: httpx.Client) -> None:
    plain = generate(client, "Hello", max_new_tokens=4)["generated_text"]
    full = generate(client, "Hello", max_new_tokens=4, return_full_text=True)["generated_text"]
    assert full == "Hello" + plain

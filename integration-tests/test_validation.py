"""Bad input gets a 422 naming the field, on both routes, and never disturbs other requests."""

from __future__ import annotations

import threading

import httpx
import pytest

BAD_PAYLOADS = [
    ({"inputs": "", "parameters": {"max_new_tokens": 4}}, "inputs"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 10_000_000}}, "max_new_tokens"),
    ({"inputs": "hi", "parameters": {"temperature": -1.0}}, "temperature"),
    ({"inputs": "hi", "parameters": {"temperature": 0.0}}, "temperature"),
    ({"inputs": "hi", "parameters": {"top_p": 1.5}}, "top_p"),
    ({"inputs": "hi", "parameters": {"top_k": 0}}, "top_k"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"inputs": 42}, "inputs"),
    ({"inputs": "hi", "parameters": {"max_tokenz": 3}}, "max_tokenz"),
    ({"parameters": {"max_new_tokens": 3}}, "inputs"),
]


def assert_validation_error(response: httpx.Response, field: str) -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_type"] == "validation"
    assert field in body["error"], body


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
@pytest.mark.parametrize(("payload", "field"), BAD_PAYLOADS)
def test_invalid_parameter_is_a_422_naming_it(
    client: httpx.Client, route: str, payload: dict, field: str
) -> None:
    assert_validation_error(client.post(route, json=payload), field)


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_malformed_json_is_a_422(client: httpx.Client, route: str) -> None:
    response = client.post(
        route,
        content=b'{"inputs": "hi", "parameters": {',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation"


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_input_longer_than_the_context_is_a_422(client: httpx.Client, route: str) -> None:
    info = client.get("/info").json()
    too_long = "hello " * (info["max_input_tokens"] + 16)
    response = client.post(route, json={"inputs": too_long, "parameters": {"max_new_tokens": 1}})
    assert_validation_error(response, "inputs")


def test_bad_requests_do_not_disturb_a_running_generation(client: httpx.Client) -> None:
    result: dict = {}

    def long_generation() -> None:
        response = client.post(
            "/generate", json={"inputs": "Tell me a story", "parameters": {"max_new_tokens": 48}}
        )
        result["status"] = response.status_code
        result["body"] = response.json()

    worker = threading.Thread(target=long_generation)
    worker.start()
    for payload, field in BAD_PAYLOADS:
        assert_validation_error(client.post("/generate", json=payload), field)
    worker.join()
    assert result["status"] == 200
    assert result["body"]["generated_text"]
    assert client.get("/health").status_code == 200

"""One JSON log schema across the launcher, the router and the shards; a request id that
follows a request from its HTTP header to the shard's log lines; the router's
OpenTelemetry traces, received by a real OTLP/HTTP endpoint run here; and the `/metrics`
series vLLM's dashboards read, counting real requests."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from conftest import LaunchedServer, launch, metrics, stop, tiny_model

TINY_BLOCKS = 64  # the tiny random Llama's cache: the logs and traces are the point

SERVICE_NAME = "cadence-observability-test"
REQUEST_ID = "obs-test-42"
FAIRNESS_ID = "tenant-a"  # the inference gateway's per-request headers
OBJECTIVE = "interactive"
CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
PROMPT = "The three primary colors are"

REQUIRED_KEYS = {"timestamp", "level", "component", "target", "message", "fields"}
OPTIONAL_KEYS = {"rank", "request_id"}
LEVELS = {"TRACE", "DEBUG", "INFO", "WARN", "ERROR"}
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class OtlpReceiver:
    """An OTLP/HTTP endpoint: decodes each POST to /v1/traces as an
    ExportTraceServiceRequest and keeps its spans with their resource's service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Span]] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                export = ExportTraceServiceRequest.FromString(body)
                receiver.keep(self.path, export)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:  # the test's output stays quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def keep(self, path: str, export: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.paths.append(path)
            for resource_spans in export.resource_spans:
                service = attributes(resource_spans.resource.attributes)["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)

    def received(self) -> list[tuple[str, Span]]:
        """Every span so far, with its service name."""
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[tuple[str, Span]]:
        return [(s, span) for s, span in self.received() if span.trace_id.hex() == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(pairs: list[KeyValue] | Any) -> dict[str, Any]:
    """OTLP attributes as a dict of plain values."""
    out: dict[str, Any] = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        out[pair.key] = getattr(pair.value, kind) if kind else None
    return out


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    otlp = OtlpReceiver()
    yield otlp
    otlp.close()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """The tiny Llama with JSON logs (shards at DEBUG, where their per-request lines are) and
    traces exported every 100 ms."""
    env = os.environ | {"OTEL_BSP_SCHEDULE_DELAY": "100", "LOGURU_LEVEL": "DEBUG"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    launched = launch(
        tmp_path_factory.mktemp("observability"),
        *("--log-format", "json", *tiny_model(tiny_llama_dir, TINY_BLOCKS)),
        *("--otlp-endpoint", receiver.url, "--otlp-service-name", SERVICE_NAME),
        env=env,
    )
    yield launched
    stop(launched)


@pytest.fixture(scope="module")
def streamed(server: LaunchedServer) -> tuple[httpx.Headers, dict[str, Any]]:
    """A streamed request with the caller's request id and trace: its response headers
    and the details of its last event."""
    headers = {
        "x-request-id": REQUEST_ID,
        "traceparent": TRACEPARENT,
        "x-gateway-inference-fairness-id": FAIRNESS_ID,
        "x-gateway-inference-objective": OBJECTIVE,
    }
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}}
    with httpx.stream(
        "POST", f"{server.url}/generate_stream", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200
        events = [
            json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")
        ]
    return response.headers, events[-1]["details"]


def log_lines(server: LaunchedServer) -> list[dict[str, Any]]:
    lines = [line for line in server.log().splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"a log line is not JSON: {line!r}")
    return parsed


def test_the_response_echoes_the_callers_request_id(streamed: tuple[httpx.Headers, Any]) -> None:
    headers, _ = streamed
    assert headers["x-request-id"] == REQUEST_ID


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
    ],
)
def test_every_generation_route_answers_with_a_request_id(
    server: LaunchedServer, path: str, body: dict[str, Any]
) -> None:
    """Without a usable id (none, or one with a space), the router makes a UUID v4."""
    ids = []
    for sent in ({}, {"x-request-id": "not usable"}):
        response = httpx.post(f"{server.url}{path}", json=body, headers=sent, timeout=120)
        assert response.status_code == 200, response.text
        ids.append(response.headers["x-request-id"])
    assert all(uuid.UUID(i).version == 4 for i in ids)
    assert ids[0] != ids[1]


def test_every_log_line_is_one_object_of_the_schema(
    server: LaunchedServer, streamed: tuple[httpx.Headers, Any]
) -> None:
    lines = log_lines(server)
    components = set()
    for line in lines:
        keys = set(line)
        assert REQUIRED_KEYS <= keys <= REQUIRED_KEYS | OPTIONAL_KEYS, line
        assert TIMESTAMP.match(line["timestamp"]), line
        assert line["level"] in LEVELS, line
        assert isinstance(line["message"], str) and isinstance(line["fields"], dict), line
        assert ("rank" in line) == (line["component"] == "shard"), line
        components.add(line["component"])
    assert components == {"launcher", "router", "shard"}


def test_the_request_id_is_on_the_routers_and_the_shards_lines(
    server: LaunchedServer, streamed: tuple[httpx.Headers, dict[str, Any]]
) -> None:
    _, details = streamed

    def ours() -> list[dict[str, Any]]:
        return [line for line in log_lines(server) if line.get("request_id") == REQUEST_ID]

    # The launcher forwards each child's lines as they come.
    wait_for(
        "the shard logging the request joining",
        lambda: any(line["component"] == "shard" for line in ours()),
    )
    router = {line["message"]: line for line in ours() if line["component"] == "router"}
    assert router["admitted"]["fields"]["input_tokens"] == details["input_length"]
    finished = router["finished"]["fields"]
    assert finished["generated_tokens"] == details["generated_tokens"]
    assert finished["finish_reason"] == details["finish_reason"]
    shard = {line["message"]: line for line in ours() if line["component"] == "shard"}
    assert shard["joined"]["rank"] == 0
    assert shard["joined"]["fields"]["tokens"] == details["input_length"]


def test_the_request_is_traced_under_the_callers_trace(
    receiver: OtlpReceiver, streamed: tuple[httpx.Headers, dict[str, Any]]
) -> None:
    _, details = streamed
    names = {"POST /generate_stream", "queue", "prefill", "decode", "stream"}
    wait_for(
        "the request's spans exported",
        lambda: names <= {span.name for _, span in receiver.trace(CALLER_TRACE_ID)},
    )
    assert set(receiver.paths) == {"/v1/traces"}
    spans = receiver.trace(CALLER_TRACE_ID)
    assert {service for service, _ in spans} == {SERVICE_NAME}
    (root,) = [span for _, span in spans if span.name == "POST /generate_stream"]
    assert root.parent_span_id.hex() == CALLER_SPAN_ID
    assert root.kind == Span.SPAN_KIND_SERVER
    root_attributes = attributes(root.attributes)
    assert root_attributes["cadence.request_id"] == REQUEST_ID
    assert root_attributes["http.response.status_code"] == 200
    assert root_attributes["gateway.inference.fairness_id"] == FAIRNESS_ID
    assert root_attributes["gateway.inference.objective"] == OBJECTIVE
    children = [span for _, span in spans if span.parent_span_id == root.span_id]
    by_name: dict[str, list[Span]] = {}
    for span in children:
        by_name.setdefault(span.name, []).append(span)
    assert set(by_name) == names - {root.name}
    for span in children:
        assert root.start_time_unix_nano <= span.start_time_unix_nano
        assert span.start_time_unix_nano <= span.end_time_unix_nano <= root.end_time_unix_nano

    (queue,) = by_name["queue"]
    prefills = sorted(by_name["prefill"], key=lambda s: s.start_time_unix_nano)
    (decode,) = by_name["decode"]
    chunks = [attributes(s.attributes) for s in prefills]
    computed = sum(c["cadence.prefill.tokens"] for c in chunks)
    assert computed + chunks[0]["cadence.prefill.cached_tokens"] == details["input_length"]
    assert attributes(queue.attributes)["cadence.prompt_tokens"] == details["input_length"]
    assert queue.end_time_unix_nano <= prefills[0].start_time_unix_nano
    assert prefills[-1].end_time_unix_nano <= decode.start_time_unix_nano
    decoded = attributes(decode.attributes)
    assert decoded["cadence.generated_tokens"] == details["generated_tokens"]
    assert decoded["cadence.finish_reason"] == details["finish_reason"]
    (stream,) = by_name["stream"]
    assert attributes(stream.attributes)["cadence.stream.chunks"] >= details["generated_tokens"]


def test_a_request_without_a_traceparent_starts_its_own_trace(
    server: LaunchedServer, receiver: OtlpReceiver
) -> None:
    response = httpx.post(
        f"{server.url}/generate",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
        timeout=120,
    )
    request_id = response.headers["x-request-id"]

    def roots() -> list[Span]:
        spans = [span for _, span in receiver.received()]
        return [
            s for s in spans if attributes(s.attributes).get("cadence.request_id") == request_id
        ]

    wait_for("the request's server span exported", lambda: bool(roots()))
    (root,) = roots()
    assert root.name == "POST /generate" and root.parent_span_id == b""

    def names() -> set[str]:
        return {span.name for _, span in receiver.trace(root.trace_id.hex())}

    wait_for("its children exported", lambda: {"queue", "prefill", "decode"} <= names())
    assert "stream" not in names()  # answered in one body


def test_vllm_request_series_count_the_requests_sent_and_their_usage(
    server: LaunchedServer,
) -> None:
    """vLLM's request-level series (the names its Grafana dashboard queries, with its
    `model_name` label) move with real requests: one finished request per request sent,
    by finish reason, token totals equal to the answers' usage, and the same counts as
    cadence's own series."""
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    before = metrics(server.url)
    sent = [("The three primary colors are", 3), ("Once upon a time", 5), ("Hi", 4)]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    reasons: dict[str, int] = {"stop": 0, "length": 0}
    for prompt, max_tokens in sent:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        answer_json = answer.json()
        for key in usage:
            usage[key] += answer_json["usage"][key]
        reasons[answer_json["choices"][0]["finish_reason"]] += 1
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    after = metrics(server.url)

    def moved(series: str, labels: str = "") -> float:
        key = f'{series}{{model_name="{model}"{labels}}}'
        assert key in after, f"{key} not in /metrics"
        return after[key] - before.get(key, 0.0)

    def cadence_moved(series: str) -> float:
        key = f'{series}{{model="{model}"}}'
        return after[key] - before.get(key, 0.0)

    requests = len(sent)
    for reason, count in reasons.items():
        assert moved("vllm:request_success_total", f',finished_reason="{reason}"') == count
    assert cadence_moved("cadence_requests_succeeded_total") == requests
    assert moved("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("vllm:generation_tokens_total") == usage["completion_tokens"]
    assert cadence_moved("cadence_prompt_tokens_total") == usage["prompt_tokens"]
    for histogram in (
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_max_tokens",
    ):
        assert moved(f"{histogram}_count") == requests, histogram
        assert moved(f"{histogram}_bucket", ',le="+Inf"') == requests, histogram
    assert moved("vllm:request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert moved("vllm:request_generation_tokens_sum") == usage["completion_tokens"]
    assert moved("vllm:request_params_max_tokens_sum") == sum(m for _, m in sent)
    # Every token after a request's first is one inter-token gap (all were sampled).
    gaps = usage["completion_tokens"] - requests
    assert moved("vllm:inter_token_latency_seconds_count") == gaps
    assert moved("vllm:time_per_output_token_seconds_count") == gaps
    # One HELP and TYPE per family; the router process and its build are described.
    types = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
    assert len(types) == len(set(types))
    assert re.search(r"^process_resident_memory_bytes \d+$", text, re.MULTILINE)
    assert re.search(r"^process_cpu_seconds_total \S+$", text, re.MULTILINE)
    assert re.search(r'^cadence_build_info\{model="[^"]*",version="[^"]+",git_sha=', text, re.M)


def test_buffered_spans_are_exported_at_shutdown(tmp_path: Path, tiny_llama_dir: str) -> None:
    """With a batch delay far beyond the test, only the flush on SIGTERM exports them."""
    otlp = OtlpReceiver()
    env = os.environ | {"OTEL_BSP_SCHEDULE_DELAY": "600000"}
    launched = launch(
        tmp_path, *tiny_model(tiny_llama_dir, TINY_BLOCKS), "--otlp-endpoint", otlp.url, env=env
    )
    try:
        response = httpx.post(
            f"{launched.url}/generate",
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
            headers={"traceparent": TRACEPARENT.replace(CALLER_TRACE_ID, "ab" * 16)},
            timeout=120,
        )
        assert response.status_code == 200
        assert otlp.trace("ab" * 16) == []
    finally:
        assert stop(launched) == 0
        otlp.close()
    assert {"POST /generate", "queue", "prefill", "decode"} <= {
        span.name for _, span in otlp.trace("ab" * 16)
    }

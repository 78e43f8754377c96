"""The container, Compose, Kubernetes, haproxy and Grafana files agree with cadence as it
runs: every `cadence launch` they write parses with the launcher's own parser, every probe
and health check asks a route a launched server answers 200, the ports line up from the
container's flags to the Service, the pool and the load balancer, the grace periods cover
the drain, and every series the dashboard queries is in a real server's /metrics."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from typing import Any

import httpx
import pytest
from cadence.cli import build_parser
from deploy_files import (
    COMPOSE,
    GRAFANA,
    HAPROXY_CFG,
    KUBERNETES,
    CadenceContainer,
    cadence_containers,
    compose,
    haproxy_directives,
    image_argv,
    kubernetes_containers,
    kubernetes_documents,
    seconds,
)

from conftest import LaunchedServer

# Beyond --shutdown-timeout, what the launcher needs after a drain (docs/deploy.md): the
# router's exit (10 s) and the shards' stop.
STOP_MARGIN_S = 15
# PromQL words that are not series names: keywords, and aggregations, which may come
# before their "by (...)" rather than their "(".
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
PROMQL_WORDS |= {"and", "or", "unless", "offset", "e", "inf", "nan"}
PROMQL_WORDS |= {"sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk"}
PROMQL_WORDS |= {"bottomk", "quantile", "count_values"}


def parse_launch(argv: list[str]) -> argparse.Namespace:
    """`argv` ("cadence launch ...") parsed by cadence's own command-line parser: an
    unknown flag or a bad value fails here as it would in the container."""
    assert argv[:2] == ["cadence", "launch"], argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exit_:
        raise AssertionError(f"`{' '.join(argv)}` does not parse: exit {exit_.code}") from None


CONTAINERS = cadence_containers()


@pytest.fixture(params=CONTAINERS, ids=[c.where for c in CONTAINERS])
def container(request: pytest.FixtureRequest) -> CadenceContainer:
    return request.param


def test_every_cadence_launch_parses_and_listens_on_the_ports_it_opens(
    container: CadenceContainer,
) -> None:
    args = parse_launch(container.argv)
    assert args.hostname == "0.0.0.0", "a container must listen beyond its loopback"
    assert container.ports == [args.port]
    assert container.probes, f"{container.where} has no health check"
    assert {port for _path, port in container.probes} == {args.port}


def test_the_files_declare_cadence_everywhere_they_should() -> None:
    where = [c.where for c in CONTAINERS]
    assert "Dockerfile" in where
    assert sum(w.startswith("docker-compose.yml") for w in where) == 2
    assert sum(w.startswith("deployment.yaml") for w in where) == 1
    assert sum(w.startswith("kserve.yaml") for w in where) == 1


def test_every_probe_path_is_a_route_a_launched_server_answers(
    smollm_server: LaunchedServer,
) -> None:
    haproxy_checks = [d[-1] for d in haproxy_directives() if d[:2] == ["http-check", "send"]]
    paths = {path for c in CONTAINERS for path, _port in c.probes} | set(haproxy_checks)
    assert {"/health", "/ready"} <= paths
    for path in sorted(paths):
        response = httpx.get(smollm_server.url + path, timeout=10)
        assert response.status_code == 200, f"GET {path}: {response.status_code}"


def grace_needed(container: CadenceContainer) -> float:
    return parse_launch(container.argv).shutdown_timeout + STOP_MARGIN_S


def test_grace_periods_cover_the_drain() -> None:
    for name, service in compose()["services"].items():
        if service.get("image", "").startswith("cadence"):
            (declared,) = [c for c in CONTAINERS if c.where == f"docker-compose.yml {name}"]
            assert seconds(service["stop_grace_period"]) >= grace_needed(declared), name
    for path, pod, container in kubernetes_containers():
        (declared,) = [c for c in CONTAINERS if c.where == f"{path.name} {container['name']}"]
        assert pod["terminationGracePeriodSeconds"] >= grace_needed(declared), path.name


def documents(kind: str) -> list[dict[str, Any]]:
    return [document for _path, document in kubernetes_documents() if document["kind"] == kind]


def the_deployment() -> tuple[dict[str, Any], dict[str, Any]]:
    (deployment,) = documents("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def test_the_service_and_the_pool_reach_the_deployments_port() -> None:
    deployment, container = the_deployment()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = parse_launch(image_argv(container.get("command"), container.get("args"))).port
    (named,) = container["ports"]
    services = {s["metadata"]["name"]: s for s in documents("Service")}
    service = services[deployment["metadata"]["name"]]
    assert service["spec"]["selector"].items() <= labels.items()
    (target,) = [p["targetPort"] for p in service["spec"]["ports"]]
    assert target in (port, named.get("name"))

    (pool,) = documents("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": named["containerPort"]}]
    picker = pool["spec"]["endpointPickerRef"]
    picker_ports = [p["port"] for p in services[picker["name"]]["spec"]["ports"]]
    assert picker["port"]["number"] in picker_ports

    (route,) = documents("HTTPRoute")
    (gateway,) = documents("Gateway")
    assert [ref["name"] for ref in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]


def test_the_kserve_service_serves_the_model_kserve_downloads() -> None:
    (service,) = documents("LLMInferenceService")
    assert service["apiVersion"] == "serving.kserve.io/v1alpha1"
    (container,) = service["spec"]["template"]["containers"]
    args = parse_launch(container["command"] + container["args"])
    assert args.model_id == "/mnt/models"  # where KServe's storage initializer puts it
    assert args.served_model_name == service["spec"]["model"]["name"]
    assert args.port == 8000  # the port KServe's InferencePool and HTTPRoute target


def test_haproxy_checks_ready_and_balances_the_compose_replicas() -> None:
    directives = haproxy_directives()
    assert ["option", "httpchk"] in directives
    assert ["http-check", "send", "meth", "GET", "uri", "/ready"] in directives
    assert ["balance", "leastconn"] in directives
    servers = {d[1]: d[2] for d in directives if d[0] == "server"}
    replicas = {c.where.split()[-1]: c for c in CONTAINERS if c.where.startswith("docker-")}
    assert servers.keys() == replicas.keys()
    for name, address in servers.items():
        assert address == f"{name}:{parse_launch(replicas[name].argv).port}"
    haproxy = compose()["services"]["haproxy"]
    assert haproxy["image"] == "haproxy:2.6"
    assert any(
        v.startswith(f"./{HAPROXY_CFG.relative_to(COMPOSE.parent)}:") for v in haproxy["volumes"]
    )


def test_haproxy_retries_only_requests_no_replica_received() -> None:
    # conn-failure is the only retry-on condition under which nothing reached a replica;
    # any other (empty-response, response-timeout, a status) can run a request twice.
    retry_on = [d[1:] for d in haproxy_directives() if d[0] == "retry-on"]
    assert retry_on == [["conn-failure"]]
    assert ["option", "redispatch"] in haproxy_directives()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")
def test_haproxy_accepts_the_config() -> None:
    done = subprocess.run(
        ["haproxy", "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- Grafana ---------------------------------------------------------------------------------


def scraped_series(text: str) -> dict[str, set[str]]:
    """Series name -> the label names it carries, from Prometheus' text format."""
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        assert match, line
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match.group(2) or ""))
        series.setdefault(match.group(1), set()).update(labels)
    return series


def queried_selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(series name, label names matched) of every series an expression selects."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    selectors = []
    for name, labels in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        selectors.append((name, set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*[=!]~?", labels))))
    # Drop functions (followed by "("), grouping labels ("by (le)"), numbers' exponents and
    # keywords: what is left names series.
    grouped = {
        g for group in re.findall(r"(?:by|without)\s*\(([^)]*)\)", expr) for g in group.split(",")
    }
    functions = set(re.findall(r"([a-zA-Z_]+)\s*\(", expr))
    skip = PROMQL_WORDS | functions | {g.strip() for g in grouped}
    return [(name, labels) for name, labels in selectors if name.lower() not in skip]


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_every_dashboard_query_selects_a_series_a_server_exports(
    smollm_server: LaunchedServer,
) -> None:
    dashboard = json.loads(GRAFANA.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    series = scraped_series(httpx.get(f"{smollm_server.url}/metrics", timeout=10).text)
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 20
    queried = set()
    for expr in exprs:
        selectors = queried_selectors(expr)
        assert selectors, expr
        for name, labels in selectors:
            assert name in series, f"{name} (in {expr}) is not in /metrics"
            assert labels <= series[name] | {"le"}, f"{name} has no label {labels}: {expr}"
            queried.add(name)
    # The panels the dashboard promises: traffic, queue, KV, latency, throughput, grammar.
    for wanted in (
        "cadence_requests_failed_total",
        "cadence_queue_waiting_requests",
        "vllm:kv_cache_usage_perc",
        "cadence_time_to_first_token_seconds_bucket",
        "cadence_inter_token_latency_seconds_bucket",
        "cadence_generation_tokens_total",
        "cadence_batch_size_count",
        "cadence_grammar_compile_seconds_bucket",
        "cadence_step_duration_seconds_bucket",
        "cadence_replica_ready",
    ):
        assert wanted in queried, wanted


def test_the_dashboards_model_variable_lists_a_real_label(smollm_server: LaunchedServer) -> None:
    dashboard = json.loads(GRAFANA.read_text())
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "model"
    match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
    assert match, variable["query"]
    series = scraped_series(httpx.get(f"{smollm_server.url}/metrics", timeout=10).text)
    assert match.group(2) in series[match.group(1)]
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert "$model" in target["expr"], target["expr"]


def test_kubernetes_files_are_all_read() -> None:
    kinds = sorted(document["kind"] for _path, document in kubernetes_documents())
    assert kinds == sorted(
        ["Deployment", "Service", "InferencePool", "Service", "Gateway", "HTTPRoute"]
        + ["LLMInferenceService"]
    ), kinds
    assert {p.name for p in KUBERNETES.glob("*.yaml")} == {
        "deployment.yaml",
        "inferencepool.yaml",
        "kserve.yaml",
    }

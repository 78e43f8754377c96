"""Reads the deployment files (Dockerfile, docker-compose.yml, deploy/) the way Docker,
Compose and Kubernetes read them, so the tests check what would run rather than a copy."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"
KUBERNETES = REPO / "deploy" / "kubernetes"
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
GRAFANA = REPO / "deploy" / "grafana" / "cadence.json"
# Where a healthcheck command names the URL it fetches.
LOCAL_URL = re.compile(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        joined.append(pending + stripped)
        pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in joined]


def dockerfile_values(instruction: str) -> list[str]:
    """The arguments of every `instruction` in the Dockerfile."""
    return [args for name, args in dockerfile_instructions() if name == instruction]


def exec_form(instruction: str) -> list[str]:
    """The last ENTRYPOINT or CMD (the one that takes effect), in exec (JSON) form."""
    return json.loads(dockerfile_values(instruction)[-1])


def image_argv(command: list[str] | None = None, args: list[str] | None = None) -> list[str]:
    """What a container of the image runs: `command` replaces ENTRYPOINT and `args`
    replaces CMD, as in Kubernetes (Compose's `command` is `args` here)."""
    entrypoint = exec_form("ENTRYPOINT") if command is None else command
    return entrypoint + (exec_form("CMD") if args is None else args)


def run_commands(containing: str) -> list[list[str]]:
    """The Dockerfile's RUN commands that mention `containing`, split into words (one per
    `&&`-separated command)."""
    found = []
    for args in dockerfile_values("RUN"):
        for command in args.split("&&"):
            if containing in command:
                found.append(shlex.split(command))
    return found


def kubernetes_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path, document


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@dataclass
class CadenceContainer:
    """One place a cadence container is declared: what it runs and how it is probed."""

    where: str
    argv: list[str]
    ports: list[int]  # the ports the declaration opens to others
    probes: list[tuple[str, int]]  # (path, port) of every health and readiness check


def _pod_spec(document: dict[str, Any]) -> dict[str, Any] | None:
    if document["kind"] == "Deployment":
        return document["spec"]["template"]["spec"]
    if document["kind"] == "LLMInferenceService":
        return document["spec"]["template"]
    return None


def kubernetes_containers() -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(file, pod spec, container) of every cadence container in deploy/kubernetes."""
    for path, document in kubernetes_documents():
        pod = _pod_spec(document)
        for container in (pod or {}).get("containers", []):
            if container["image"].startswith("cadence"):
                yield path, pod, container


def cadence_containers() -> list[CadenceContainer]:
    """Every cadence container the Dockerfile, docker-compose.yml and deploy/kubernetes
    declare."""
    found = [
        CadenceContainer(
            "Dockerfile",
            image_argv(),
            [int(port) for value in dockerfile_values("EXPOSE") for port in value.split()],
            _url_probes(" ".join(dockerfile_values("HEALTHCHECK"))),
        )
    ]
    for name, service in compose()["services"].items():
        if service.get("image", "").startswith("cadence"):
            found.append(
                CadenceContainer(
                    f"docker-compose.yml {name}",
                    image_argv(args=service.get("command")),
                    [int(port) for port in service.get("expose", [])],
                    _url_probes(" ".join(service["healthcheck"]["test"])),
                )
            )
    for path, _pod, container in kubernetes_containers():
        probes = [
            (container[kind]["httpGet"]["path"], container[kind]["httpGet"]["port"])
            for kind in ("startupProbe", "livenessProbe", "readinessProbe")
            if kind in container
        ]
        found.append(
            CadenceContainer(
                f"{path.name} {container['name']}",
                image_argv(container.get("command"), container.get("args")),
                [port["containerPort"] for port in container.get("ports", [])],
                probes,
            )
        )
    return found


def _url_probes(command: str) -> list[tuple[str, int]]:
    return [(path, int(port)) for port, path in LOCAL_URL.findall(command)]


def seconds(duration: str | int) -> float:
    """Compose's durations ("50s", "1m30s") in seconds."""
    if isinstance(duration, int):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def haproxy_directives() -> list[list[str]]:
    """The haproxy config's lines, split into words, comments dropped."""
    lines = (line.split("#", 1)[0].split() for line in HAPROXY_CFG.read_text().splitlines())
    return [words for words in lines if words]

"""Several tenants at once: `cadence bench --tenants FILE` drives one workload per tenant,
each with its own API key, request count, lengths, arrival rate and concurrency cap, all
against the same server in the same run, and reports each tenant's numbers beside the
total (what fair scheduling and per-tenant limits are judged by).

The file (YAML or JSON) is a list of tenants:

    - name: batch                      # the report's name for it
      api_key_env: BATCH_KEY           # or api_key: sk-... (the environment keeps it off files)
      num_prompts: 48
      max_concurrency: 48
      input_len: 320                   # N or LOW:HIGH; default: --input-len
      output_len: 256
    - name: interactive
      api_key_env: CHAT_KEY
      num_prompts: 10
      request_rate: 1.0                # requests per second; default: all at once
      output_len: 32

Prompts are the random dataset's (seeded per tenant by its position), so a tenant's
requests are the same from run to run."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cadence_bench.datasets import BenchRequest
from cadence_bench.metrics import RequestOutput, summarize
from cadence_bench.runner import RunConfig, run_benchmark

TENANT_FIELDS = {
    "name",
    "api_key",
    "api_key_env",
    "num_prompts",
    "input_len",
    "output_len",
    "request_rate",
    "burstiness",
    "max_concurrency",
}


@dataclass(slots=True)
class TenantLoad:
    name: str
    api_key: str | None
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None


def parse_length(value: Any, field: str) -> tuple[int, int]:
    """N or LOW:HIGH (as --input-len takes it)."""
    text = str(value)
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not N or LOW:HIGH") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"{field}: {text!r} needs 1 <= LOW <= HIGH")
    return bounds


def _api_key(entry: dict[str, Any], where: str) -> str | None:
    if "api_key_env" in entry:
        name = entry["api_key_env"]
        if name not in os.environ:
            raise ValueError(f"{where}.api_key_env: {name} is not set in the environment")
        return os.environ[name]
    key = entry.get("api_key")
    return None if key is None else str(key)


def read_tenants(
    path: str | Path, input_len: tuple[int, int], output_len: tuple[int, int]
) -> list[TenantLoad]:
    """The tenants of a YAML or JSON file; lengths default to the flags'. Errors name the
    entry and field."""
    import yaml  # JSON is YAML too

    try:
        entries = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not YAML or JSON ({err})".replace("\n", " ")) from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: a non-empty list of tenants")
    tenants, names = [], set()
    for i, entry in enumerate(entries):
        where = f"{path}: tenant {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: a mapping of {', '.join(sorted(TENANT_FIELDS))}")
        unknown = set(entry) - TENANT_FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        name = str(entry.get("name", f"tenant-{i}"))
        if name in names:
            raise ValueError(f"{where}.name: {name!r} twice")
        names.add(name)
        num = int(entry.get("num_prompts", 0))
        if num < 1:
            raise ValueError(f"{where}.num_prompts: a positive number of requests")
        concurrency = entry.get("max_concurrency")
        tenants.append(
            TenantLoad(
                name=name,
                api_key=_api_key(entry, where),
                num_prompts=num,
                input_len=parse_length(entry["input_len"], f"{where}.input_len")
                if "input_len" in entry
                else input_len,
                output_len=parse_length(entry["output_len"], f"{where}.output_len")
                if "output_len" in entry
                else output_len,
                request_rate=float(entry.get("request_rate", float("inf"))),
                burstiness=float(entry.get("burstiness", 1.0)),
                max_concurrency=None if concurrency is None else int(concurrency),
            )
        )
    return tenants


def tenant_requests(
    tokenizer: Any, tenants: list[TenantLoad], seed: int
) -> list[list[BenchRequest]]:
    from cadence_bench.datasets import random_dataset

    return [
        random_dataset(tokenizer, t.num_prompts, t.input_len, t.output_len, seed + 1000 * i)
        for i, t in enumerate(tenants)
    ]


async def _run_all(
    cfg: RunConfig, tenants: list[TenantLoad], requests: list[list[BenchRequest]]
) -> tuple[list[tuple[list[RequestOutput], float]], float]:
    start = time.perf_counter()
    runs = [
        run_benchmark(
            replace(
                cfg,
                api_key=t.api_key,
                request_rate=t.request_rate,
                burstiness=t.burstiness,
                max_concurrency=t.max_concurrency,
                seed=cfg.seed + i,
                progress=False,
            ),
            reqs,
        )
        for i, (t, reqs) in enumerate(zip(tenants, requests, strict=True))
    ]
    results = await asyncio.gather(*runs)
    return list(results), time.perf_counter() - start


def measure_tenants(
    cfg: RunConfig, tenants: list[TenantLoad], requests: list[list[BenchRequest]]
) -> dict[str, Any]:
    """Every tenant's summary under `tenants`, and the whole run's at the top level."""
    results, duration = asyncio.run(_run_all(cfg, tenants, requests))
    every = [o for outputs, _ in results for o in outputs]
    result: dict[str, Any] = summarize(every, duration)
    result["num_prompts"] = len(every)
    result["errors"] = sorted({o.error for o in every if not o.success})[:5]
    result["tenants"] = {
        t.name: summarize(outputs, tenant_duration) | {"num_prompts": t.num_prompts}
        for t, (outputs, tenant_duration) in zip(tenants, results, strict=True)
    }
    return result


def tenants_table(result: dict[str, Any]) -> str:
    """One line per tenant: completed, failed, output tok/s, TTFT mean and p99, TPOT."""
    header = f"{'tenant':<16}{'done':>6}{'fail':>6}{'out tok/s':>11}{'TTFT ms':>10}"
    header += f"{'p99 TTFT':>10}{'TPOT ms':>9}"
    lines = ["{:-^68}".format(" Per tenant "), header]
    for name, t in result["tenants"].items():
        lines.append(
            f"{name[:15]:<16}{t['completed']:>6}{t['failed']:>6}{t['output_throughput']:>11.1f}"
            f"{t['mean_ttft_ms']:>10.1f}{t['p99_ttft_ms']:>10.1f}{t['mean_tpot_ms']:>9.1f}"
        )
    return "\n".join(lines)

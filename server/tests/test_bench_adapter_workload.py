"""Which adapter each benchmark request asks for: the distributions' frequencies within
statistical bounds, draws reproducible from the seed, the adapter carried in the request
bodies of both APIs, the counts in the JSON record, and the launch flag."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from cadence.cli import build_parser
from cadence_bench.adapter_workload import (
    Distribution,
    adapter_counts,
    assign_adapters,
    draw_adapters,
    list_adapters,
    parse_distribution,
    probabilities,
    with_lora_dir,
)
from cadence_bench.client import _openai_body, _tgi_body
from cadence_bench.command import _plain, with_adapters
from cadence_bench.datasets import BenchRequest

NAMES = [f"adapter-{i:04d}" for i in range(8)]
DRAWS = 40_000


def test_distribution_flag() -> None:
    assert parse_distribution("uniform") == Distribution("uniform")
    assert parse_distribution("zipf") == Distribution("zipf", 1.0)
    assert parse_distribution("zipf:1.5") == Distribution("zipf", 1.5)
    assert str(parse_distribution("zipf:1.5")) == "zipf:1.5"
    for bad in ("zipf:0", "zipf:x", "poisson", "uniform:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_distribution(bad)


def test_zipf_probabilities_fall_as_a_power_of_the_rank() -> None:
    p = probabilities(5, Distribution("zipf", 1.5))
    assert p.sum() == pytest.approx(1.0)
    assert p[0] / p[1] == pytest.approx(2**1.5)
    assert p[0] / p[4] == pytest.approx(5**1.5)
    assert np.allclose(probabilities(4, Distribution("uniform")), 0.25)


@pytest.mark.parametrize("dist", [Distribution("uniform"), Distribution("zipf", 1.2)])
def test_draw_frequencies_match_the_distribution(dist: Distribution) -> None:
    drawn = draw_adapters(DRAWS, NAMES, dist, seed=7)
    counts = np.array([drawn.count(n) for n in NAMES])
    p = probabilities(len(NAMES), dist)
    sigma = np.sqrt(DRAWS * p * (1 - p))  # binomial count per adapter
    assert np.all(np.abs(counts - DRAWS * p) < 5 * sigma), (counts, DRAWS * p)


def test_draws_follow_the_seed_and_leave_the_requests_alone() -> None:
    requests = [BenchRequest(f"prompt {i}", 3, 4) for i in range(64)]
    dist = Distribution("uniform")
    first = assign_adapters(requests, NAMES, dist, seed=1)
    assert first == assign_adapters(requests, NAMES, dist, seed=1)
    assert first != assign_adapters(requests, NAMES, dist, seed=2)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in first] == [
        (r.prompt, r.prompt_len, r.output_len) for r in requests
    ]
    counts = adapter_counts(first)
    assert sum(counts.values()) == len(requests)
    assert list(counts.values()) == sorted(counts.values(), reverse=True)
    assert counts == {n: sum(r.adapter == n for r in first) for n in counts}


def test_one_adapter_gets_every_request() -> None:
    requests = [BenchRequest("p", 1, 1)] * 5
    assert adapter_counts(assign_adapters(requests, NAMES[:1], Distribution("zipf", 2), 0)) == {
        NAMES[0]: 5
    }


def _adapter_folders(root: Path, names: list[str]) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text("{}")
    (root / "not-an-adapter").mkdir()
    return root


def test_adapters_are_listed_in_name_order(tmp_path: Path) -> None:
    root = _adapter_folders(tmp_path, list(reversed(NAMES[:3])))
    assert list_adapters(root) == NAMES[:3]
    assert list_adapters(root, 2) == NAMES[:2]
    with pytest.raises(ValueError, match="holds 3 adapters, fewer than the 4"):
        list_adapters(root, 4)


def test_request_bodies_name_the_adapter() -> None:
    plain = BenchRequest("hi", 1, 8)
    adapted = BenchRequest("hi", 1, 8, adapter="adapter-0003")
    assert "adapter_id" not in _tgi_body(plain, True, None)["parameters"]
    assert _tgi_body(adapted, True, None)["parameters"]["adapter_id"] == "adapter-0003"
    assert _openai_body(plain, True, "base-model", None)["model"] == "base-model"
    assert _openai_body(adapted, True, "base-model", None)["model"] == "adapter-0003"


def test_the_bench_flags_draw_adapters_into_the_record(tmp_path: Path) -> None:
    root = _adapter_folders(tmp_path, NAMES)
    args = build_parser().parse_args(
        ["bench", "--lora-adapters-dir", str(root), "--num-adapters", "3"]
        + ["--adapter-distribution", "zipf:1.5", "--seed", "9"]
    )
    requests = [BenchRequest(f"prompt {i}", 3, 4) for i in range(200)]
    adapted, record = with_adapters(args, requests)
    assert record is not None
    assert record["num_adapters"] == 3 and record["distribution"] == "zipf:1.5"
    assert set(record["counts"]) <= set(NAMES[:3])
    assert sum(record["counts"].values()) == 200
    assert record["adapters_used"] == len(record["counts"])
    assert adapted == assign_adapters(requests, NAMES[:3], Distribution("zipf", 1.5), 9)
    config = {k: _plain(v) for k, v in vars(args).items() if k != "run"}
    assert json.loads(json.dumps(config))["adapter_distribution"] == "zipf:1.5"
    assert with_adapters(build_parser().parse_args(["bench"]), requests) == (requests, None)


def test_the_launch_is_told_the_adapter_folder_once() -> None:
    assert with_lora_dir(["--max-batch-size", "8"], "/a") == [
        "--max-batch-size",
        "8",
        "--lora-dir",
        "/a",
    ]
    assert with_lora_dir(["--lora-dir", "/b"], "/a") == ["--lora-dir", "/b"]
    assert with_lora_dir(["--lora-adapters=x=/p"], "/a") == ["--lora-adapters=x=/p"]


def test_bench_subcommands_take_out_despite_the_output_flags() -> None:
    args = build_parser().parse_args(
        ["bench", "make-adapters", "--model", "m", "--count", "3", "--out", "o"]
    )
    assert (args.model, args.count, args.out, args.rank, args.targets) == (
        "m",
        3,
        "o",
        8,
        "q_proj,v_proj",
    )
    args = build_parser().parse_args(
        ["bench", "merge-adapter", "--model", "m", "--adapter", "a", "--out", "o"]
    )
    assert (args.model, args.adapter, args.out) == ("m", "a", "o")
    assert math.isinf(build_parser().parse_args(["bench"]).request_rate)

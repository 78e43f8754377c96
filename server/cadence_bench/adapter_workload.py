"""Which LoRA adapter each request of a workload asks for: `--lora-adapters-dir DIR
--num-adapters N --adapter-distribution uniform|zipf[:alpha]`.

The adapters are the first N folders of DIR holding an adapter_config.json, in name
order; each request draws one of them, uniformly or by a bounded Zipf law (the i-th
adapter in name order drawn with probability proportional to 1 / i^alpha: a few popular
adapters and a long tail, as S-LoRA's workloads). The draws have their own random stream
from the seed, so the prompts and arrivals are the same with or without adapters.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cadence_bench.adapter_maker import ADAPTER_CONFIG
from cadence_bench.datasets import BenchRequest

DEFAULT_ZIPF_ALPHA = 1.0
# Mixed into the seed so the adapter draws never repeat the dataset's own stream.
ADAPTER_STREAM = 0x10AA


@dataclass(frozen=True, slots=True)
class Distribution:
    kind: str  # "uniform" or "zipf"
    alpha: float = 0.0

    def __str__(self) -> str:
        return self.kind if self.kind == "uniform" else f"zipf:{self.alpha:g}"


def parse_distribution(text: str) -> Distribution:
    """`uniform`, `zipf` (alpha 1) or `zipf:ALPHA` (ALPHA > 0)."""
    kind, _, alpha = text.partition(":")
    if kind == "uniform" and not alpha:
        return Distribution("uniform")
    if kind == "zipf":
        try:
            value = float(alpha) if alpha else DEFAULT_ZIPF_ALPHA
        except ValueError:
            value = -1.0
        if value > 0:
            return Distribution("zipf", value)
    raise argparse.ArgumentTypeError(f"{text!r} is not uniform, zipf or zipf:ALPHA (ALPHA > 0)")


def probabilities(num_adapters: int, dist: Distribution) -> np.ndarray:
    """P(adapter i) for i in name order."""
    if dist.kind == "uniform":
        return np.full(num_adapters, 1.0 / num_adapters)
    weights = 1.0 / np.arange(1, num_adapters + 1, dtype=np.float64) ** dist.alpha
    return weights / weights.sum()


def list_adapters(adapters_dir: str | Path, num_adapters: int | None = None) -> list[str]:
    """The first `num_adapters` (None: all) adapter folder names of the directory, in name
    order."""
    folder = Path(adapters_dir)
    names = sorted(p.name for p in folder.iterdir() if (p / ADAPTER_CONFIG).is_file())
    if num_adapters is None:
        num_adapters = len(names)
    if not names or len(names) < num_adapters:
        raise ValueError(
            f"{folder} holds {len(names)} adapters, fewer than the {num_adapters} asked for "
            "(`cadence bench make-adapters` makes more)"
        )
    return names[:num_adapters]


def draw_adapters(count: int, names: list[str], dist: Distribution, seed: int) -> list[str]:
    rng = np.random.default_rng([seed, ADAPTER_STREAM])
    picks = rng.choice(len(names), size=count, p=probabilities(len(names), dist))
    return [names[int(i)] for i in picks]


def assign_adapters(
    requests: list[BenchRequest], names: list[str], dist: Distribution, seed: int
) -> list[BenchRequest]:
    drawn = draw_adapters(len(requests), names, dist, seed)
    return [dataclasses.replace(r, adapter=a) for r, a in zip(requests, drawn, strict=True)]


def adapter_counts(requests: list[BenchRequest]) -> dict[str, int]:
    """Requests per adapter, most asked first (ties in name order); requests without an
    adapter are left out."""
    counts = Counter(r.adapter for r in requests if r.adapter is not None)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def workload_record(
    adapters_dir: str, names: list[str], dist: Distribution, requests: list[BenchRequest]
) -> dict[str, object]:
    """What the JSON result says about the adapters of the run."""
    counts = adapter_counts(requests)
    return {
        "dir": adapters_dir,
        "num_adapters": len(names),
        "distribution": str(dist),
        "adapters_used": len(counts),
        "counts": counts,
    }


# How `cadence launch` is told where adapters live: a name N it does not know is loaded
# from DIR/N on first use (router/src/args.rs).
LORA_DIR_FLAG = "--lora-dir"


def with_lora_dir(server_args: list[str], adapters_dir: str) -> list[str]:
    """The launch flags, with `--lora-dir DIR` added unless they already name adapters."""
    if any(a.split("=")[0] in (LORA_DIR_FLAG, "--lora-adapters") for a in server_args):
        return list(server_args)
    return [*server_args, LORA_DIR_FLAG, adapters_dir]

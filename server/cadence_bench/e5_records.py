"""What E5 measured, as plain records: written to JSON beside the document, and read back
to render it (`e5_report`) without measuring again."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cadence_bench.e5_arithmetic import MergedEstimate, ShareTime, compose_merged, ratio


@dataclass(slots=True)
class ServedRun:
    """One launch serving the whole workload: the base model (num_adapters 0) or LoRA
    with requests over `num_adapters` adapters."""

    num_adapters: int
    counts: dict[str, int] = field(default_factory=dict)  # requests per adapter
    result: dict[str, Any] = field(default_factory=dict)  # metrics.summarize's
    error: str = ""  # why it did not run

    @property
    def tok_s(self) -> float:
        return float(self.result.get("output_throughput", 0.0))


@dataclass(slots=True)
class RealMerged:
    """The merged deployment run for real: every used adapter's copy merged, launched,
    fed its share, stopped, one after the other."""

    num_adapters: int
    output_tokens: int
    total_s: float  # launches to first token + shares + stops
    mean_switch_s: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0


@dataclass(slots=True)
class E5Records:
    plan: dict[str, Any]
    machine: str  # the CPU and its instruction sets
    base: ServedRun
    lora: list[ServedRun]
    shares: dict[int, ShareTime]  # one merged copy, by share size
    switch_s: float  # a merged copy's launch to its first token
    weights_read_s: float  # reading a merged copy's weights (page cache warm)
    real: list[RealMerged] = field(default_factory=list)
    probes: dict[str, str] = field(default_factory=dict)  # greedy text per server
    load_average: tuple[float, float] = (0.0, 0.0)  # at the start and the end

    def merged(self, run: ServedRun, switch_s: float) -> MergedEstimate:
        return compose_merged(run.counts.values(), self.shares, switch_s)

    def real_for(self, num_adapters: int) -> RealMerged | None:
        return next((r for r in self.real if r.num_adapters == num_adapters), None)

    def share_of_base(self, run: ServedRun) -> float:
        return ratio(run.tok_s, self.base.tok_s)


def to_json(records: E5Records) -> str:
    data = asdict(records)
    data["shares"] = {str(k): v for k, v in data["shares"].items()}
    return json.dumps(data, indent=1) + "\n"


def from_json(text: str) -> E5Records:
    data = json.loads(text)
    return E5Records(
        plan=data["plan"],
        machine=data["machine"],
        base=ServedRun(**data["base"]),
        lora=[ServedRun(**r) for r in data["lora"]],
        shares={int(k): ShareTime(**v) for k, v in data["shares"].items()},
        switch_s=data["switch_s"],
        weights_read_s=data["weights_read_s"],
        real=[RealMerged(**r) for r in data["real"]],
        probes=data["probes"],
        load_average=tuple(data["load_average"]),
    )


def save(records: E5Records, path: Path) -> None:
    path.write_text(to_json(records))

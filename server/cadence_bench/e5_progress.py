"""E5's measurements so far, kept beside its report as each launch finishes, so a run of
most of an hour resumes where it stopped and can measure one configuration at a time
(`--only`): the base model, LoRA at each adapter count, the merged copy's shares, the
merged deployment run for real at each small adapter count."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cadence_bench.e5_arithmetic import ShareTime
from cadence_bench.e5_records import RealMerged, ServedRun

PROGRESS_FILE = "E5-progress.json"


@dataclass(slots=True)
class MergedShares:
    """One merged copy serving each share size, its launch and its weights' read time."""

    shares: dict[int, ShareTime]
    switch_s: float
    weights_read_s: float


@dataclass(slots=True)
class E5Progress:
    """What has been measured for `plan` (a run with another plan starts afresh)."""

    plan: dict[str, Any]
    base: ServedRun | None = None
    lora: dict[int, ServedRun] = field(default_factory=dict)
    merged: MergedShares | None = None
    real: dict[int, RealMerged] = field(default_factory=dict)
    probes: dict[str, str] = field(default_factory=dict)
    load_start: float = 0.0  # the 1-minute load average when the first launch started

    def slugs(self) -> list[str]:
        """Every configuration of the plan, in the order a run measures them."""
        counts = self.plan["adapter_counts"]
        real = [n for n in counts if n <= self.plan["real_merged_max"]]
        return ["base", *(f"lora-{n}" for n in counts), "merged", *(f"real-{n}" for n in real)]

    def done(self, slug: str) -> bool:
        if slug == "base":
            return self.base is not None
        if slug == "merged":
            return self.merged is not None
        kind, _, n = slug.partition("-")
        return int(n) in (self.lora if kind == "lora" else self.real)

    def missing(self) -> list[str]:
        return [s for s in self.slugs() if not self.done(s)]


def to_json(progress: E5Progress) -> str:
    data = asdict(progress)
    if progress.merged is not None:
        data["merged"]["shares"] = {str(k): v for k, v in data["merged"]["shares"].items()}
    data["lora"] = {str(k): v for k, v in data["lora"].items()}
    data["real"] = {str(k): v for k, v in data["real"].items()}
    return json.dumps(data, indent=1) + "\n"


def from_json(text: str) -> E5Progress:
    data = json.loads(text)
    merged = data.get("merged")
    return E5Progress(
        plan=data["plan"],
        base=ServedRun(**data["base"]) if data.get("base") else None,
        lora={int(k): ServedRun(**v) for k, v in data.get("lora", {}).items()},
        merged=MergedShares(
            {int(k): ShareTime(**v) for k, v in merged["shares"].items()},
            merged["switch_s"],
            merged["weights_read_s"],
        )
        if merged
        else None,
        real={int(k): RealMerged(**v) for k, v in data.get("real", {}).items()},
        probes=data.get("probes", {}),
        load_start=data.get("load_start", 0.0),
    )


def load(out: Path, plan: dict[str, Any], fresh: bool) -> E5Progress:
    """The progress recorded in `out` for `plan`; an empty one when there is none, it was
    made for another plan, or `fresh` asks to measure everything again."""
    plan = json.loads(json.dumps(plan))  # as the file holds it (lists, not tuples)
    path = out / PROGRESS_FILE
    if not fresh and path.exists():
        progress = from_json(path.read_text())
        if progress.plan == plan:
            return progress
    return E5Progress(plan)


def save(progress: E5Progress, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (PROGRESS_FILE + ".tmp")
    tmp.write_text(to_json(progress))
    tmp.replace(out / PROGRESS_FILE)  # a run killed mid-write keeps the previous file

"""One JSON record per measured configuration of an experiment, written the moment it is
measured: `<out-dir>/records/<E>/<slug>.json`. A record carries a fingerprint of what
determines the measurement (the experiment, its scale, lengths, rates, server flags,
seed); a later run with the same fingerprint reuses it instead of measuring again, so a
long experiment resumes where it stopped, and its report is rendered from the records."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def plain(value: Any) -> Any:
    """JSON-safe: infinities as "inf" (an all-at-once rate), tuples as lists."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def fingerprint(determinants: dict[str, Any]) -> str:
    """A short hash of the settings a measurement depends on (key order irrelevant)."""
    text = json.dumps(plain(determinants), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class Record:
    """A configuration's measurement: its `config` (the table's key columns), metrics'
    `summarize()` result, per-request latencies, the router's step trace over the run,
    anything else the experiment's report needs (`extras`), and what determined it."""

    experiment: str
    slug: str
    config: dict[str, Any]
    result: dict[str, Any]
    latencies: list[float] = field(default_factory=list)
    trace: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    determinants: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    measured_at: str = ""


def to_json(record: Record) -> str:
    """One line per field: readable with `cat`, compact for long latency lists and
    metric series."""
    fields = plain(asdict(record))
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in fields.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def from_json(text: str) -> Record:
    return Record(**json.loads(text))


@dataclass(slots=True)
class RecordStore:
    """The records of one experiment under `out_dir/records/<experiment>/`.

    `only`: measure only slugs containing one of these texts; `fresh`: ignore the
    records on disk (measure everything selected again, overwriting them)."""

    out_dir: Path
    experiment: str
    only: tuple[str, ...] = ()
    fresh: bool = False

    @property
    def folder(self) -> Path:
        return self.out_dir / "records" / self.experiment

    def path(self, slug: str) -> Path:
        return self.folder / f"{slug}.json"

    def selected(self, slug: str) -> bool:
        return not self.only or any(text in slug for text in self.only)

    def stored(self, slug: str, print_: str) -> Record | None:
        """The record of `slug` on disk when its fingerprint is `print_` (else None)."""
        path = self.path(slug)
        if not path.is_file():
            return None
        try:
            record = from_json(path.read_text())
        except (ValueError, TypeError):
            return None  # a record cut short or from an older layout: measure again
        if record.result.get("failed", 0):
            return None  # requests were lost (an older run): it measured another workload
        return record if record.fingerprint == print_ else None

    def reusable(self, slug: str, print_: str) -> Record | None:
        """What a run may skip measuring: the stored record, unless --fresh."""
        return None if self.fresh else self.stored(slug, print_)

    def save(self, record: Record) -> Path:
        """Writes the record at once (to a temporary name first, so an interrupted write
        never leaves a half record under the real name)."""
        record.measured_at = record.measured_at or time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(record.slug)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(to_json(record))
        tmp.replace(path)
        return path

"""Prints the table of an alternated run of servers (`alternate.sh`): one row per server,
its output tok/s and mean / p99 TTFT in each round, from the JSON results `cadence bench
--result-file` wrote as `round{R}-{server}.json` in one folder.

    python3 benchmarks/peers/peers_table.py RESULTS_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_RESULT_NAME = re.compile(r"round(\d+)-(.+)\.json")


def load(folder: Path) -> dict[str, dict[int, dict]]:
    """{server: {round: result}} for every result file in `folder`."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(folder.glob("round*-*.json")):
        match = _RESULT_NAME.fullmatch(path.name)
        if match:
            rounds = runs.setdefault(match[2], {})
            rounds[int(match[1])] = json.loads(path.read_text())
    return runs


def _cell(result: dict | None) -> str:
    if result is None:
        return "-"
    text = (
        f"{result['output_throughput']:.1f} "
        f"({result['mean_ttft_ms']:,.0f} / {result['p99_ttft_ms']:,.0f})"
    )
    return text + (f", {result['failed']} failed" if result.get("failed") else "")


def table(runs: dict[str, dict[int, dict]], order: list[str]) -> str:
    """Markdown: each cell is output tok/s (mean TTFT / p99 TTFT in ms)."""
    rounds = sorted({r for by_round in runs.values() for r in by_round})
    names = [n for n in order if n in runs] + sorted(set(runs) - set(order))
    head = ["server", *(f"round {r}" for r in rounds)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in names:
        cells = [_cell(runs[name].get(r)) for r in rounds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    folder = Path(argv[1])
    order = argv[2].split(",") if len(argv) > 2 else []
    runs = load(folder)
    if not runs:
        print(f"no results in {folder}", file=sys.stderr)
        return 1
    print("output tok/s (mean TTFT / p99 TTFT, ms)\n")
    print(table(runs, order))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Prints the table of an alternated run of servers (`alternate.sh`): one row per server,
its output tok/s and mean / p99 TTFT in each round, from the JSON results `cadence bench
--result-file` wrote as `round{R}-{server}.json` in one folder; then, where cadence's
default launch ran, its rate against each other server's, per round and over the rounds
(the sum of its rates over the sum of the other's, rounds both finished; three decimals,
so a ratio just under 2 does not print as 2.00), and in how many of those rounds its p99
time to first token was the lower.

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


def ordered(runs: dict[str, dict[int, dict]], order: list[str]) -> list[str]:
    """The servers that ran: those of `order` first, in its order, then the rest by name."""
    return [n for n in order if n in runs] + sorted(set(runs) - set(order))


def table(runs: dict[str, dict[int, dict]], order: list[str]) -> str:
    """Markdown: each cell is output tok/s (mean TTFT / p99 TTFT in ms)."""
    rounds = sorted({r for by_round in runs.values() for r in by_round})
    names = ordered(runs, order)
    head = ["server", *(f"round {r}" for r in rounds)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in names:
        cells = [_cell(runs[name].get(r)) for r in rounds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BASE = "cadence-default"


def against(runs: dict[str, dict[int, dict]], order: list[str], base: str = BASE) -> str:
    """A line per other server: `base`'s output rate over its rate in each round both ran
    (a failed request leaves the round out), over all of them, and the rounds where
    `base`'s p99 TTFT was lower. Empty without `base`."""
    if base not in runs:
        return ""
    names = ordered(runs, order)
    lines = []
    for name in names:
        if name == base:
            continue
        shared = [
            r
            for r in sorted(set(runs[base]) & set(runs[name]))
            if not runs[base][r].get("failed") and not runs[name][r].get("failed")
        ]
        rates = [
            (runs[base][r]["output_throughput"], runs[name][r]["output_throughput"]) for r in shared
        ]
        if not rates or any(theirs <= 0 for _, theirs in rates):
            continue
        per_round = ", ".join(f"{ours / theirs:.3f}x" for ours, theirs in rates)
        ours, theirs = sum(o for o, _ in rates), sum(t for _, t in rates)
        lower = sum(runs[base][r]["p99_ttft_ms"] < runs[name][r]["p99_ttft_ms"] for r in shared)
        lines.append(
            f"{base} against {name}: {per_round} per round; {ours / theirs:.3f}x over "
            f"{len(rates)} round{'s' if len(rates) > 1 else ''} ({ours / len(rates):.1f} against "
            f"{theirs / len(rates):.1f} tok/s); p99 TTFT lower in {lower} of {len(rates)}"
        )
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
    ratios = against(runs, order)
    if ratios:
        print("\n" + ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""`python -m cadence.bench`: launches cadence once per batching mode on the same
workload and prints a table (markdown) of throughput and latency.

    python -m cadence.bench --modes continuous dynamic static none --num-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from cadence.bench.client import Workload, run

COLUMNS = (
    "output_tok_s",
    "req_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_s",
    "e2e_p99_s",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(os.path.join(tempfile.gettempdir(), f"cadence-bench-{mode}.log"), "w")  # noqa: SIM115
    argv = [sys.executable, "-m", "cadence", "launch", "--port", str(port), "--batching", mode]
    proc = subprocess.Popen(
        argv + extra, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cadence launch ({mode}) exited; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"cadence launch ({mode}) not ready")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cadence.bench", description=__doc__)
    p.add_argument("--modes", nargs="+", default=["continuous", "dynamic", "static", "none"])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=0.0, help="0: all at once")
    p.add_argument("--url", help="benchmark a running server instead (one row)")
    p.add_argument("launch_args", nargs=argparse.REMAINDER, help="after --: cadence launch flags")
    args = p.parse_args(argv)
    w = Workload(args.num_requests, args.prompt_words, args.max_new_tokens, args.request_rate)
    extra = [a for a in args.launch_args if a != "--"]
    print("| mode | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    targets = [("server", args.url)] if args.url else [(m, None) for m in args.modes]
    for mode, url in targets:
        proc = None
        if url is None:
            proc, url = _launch(mode, extra)
        try:
            asyncio.run(run(url, Workload(2, 8, 4)))  # warm-up
            s = asyncio.run(run(url, w)).summary()
        finally:
            if proc is not None:
                _stop(proc)
        print(f"| {mode} | " + " | ".join(f"{s[c]:.2f}" for c in COLUMNS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

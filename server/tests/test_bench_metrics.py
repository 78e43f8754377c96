"""`cadence bench`'s metrics on synthetic timestamps, against answers worked by hand."""

from __future__ import annotations

import pytest
from cadence_bench.metrics import RequestOutput, summarize


def _outputs() -> list[RequestOutput]:
    # A: sent at 0, tokens at 0.1, 0.3, 0.6 s. B: one token at 0.2 s. C: failed.
    a = RequestOutput(True, prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.2, 0.3], latency=0.6)
    b = RequestOutput(True, prompt_len=20, output_tokens=1, ttft=0.2, itl=[], latency=0.2)
    c = RequestOutput(False, prompt_len=40, error="HTTP 500")
    return [a, b, c]


def test_counts_and_throughputs() -> None:
    r = summarize(_outputs(), duration=2.0)
    assert (r["completed"], r["failed"]) == (2, 1)
    # The failed request's prompt is not counted.
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 4)
    assert r["request_throughput"] == pytest.approx(1.0)  # 2 requests / 2 s
    assert r["output_throughput"] == pytest.approx(2.0)  # 4 tokens / 2 s
    assert r["total_token_throughput"] == pytest.approx(17.0)  # (30 + 4) / 2 s


def test_latency_statistics() -> None:
    r = summarize(_outputs(), duration=2.0)
    # TTFT 100 and 200 ms; linear interpolation: p90 = 100 + 0.9 * 100.
    assert r["mean_ttft_ms"] == pytest.approx(150.0)
    assert r["median_ttft_ms"] == pytest.approx(150.0)
    assert r["p90_ttft_ms"] == pytest.approx(190.0)
    assert r["p99_ttft_ms"] == pytest.approx(199.0)
    assert r["std_ttft_ms"] == pytest.approx(50.0)
    # TPOT only for A (B has one token): (600 - 100) / (3 - 1) = 250 ms.
    assert r["mean_tpot_ms"] == pytest.approx(250.0)
    assert r["p99_tpot_ms"] == pytest.approx(250.0)
    # ITL pools every gap: 200 and 300 ms.
    assert r["mean_itl_ms"] == pytest.approx(250.0)
    assert r["p90_itl_ms"] == pytest.approx(290.0)
    # E2E 600 and 200 ms: p99 = 200 + 0.99 * 400.
    assert r["mean_e2el_ms"] == pytest.approx(400.0)
    assert r["median_e2el_ms"] == pytest.approx(400.0)
    assert r["p99_e2el_ms"] == pytest.approx(596.0)


def test_all_failed_gives_zeros_not_errors() -> None:
    r = summarize([RequestOutput(False, prompt_len=5)], duration=1.0)
    assert (r["completed"], r["failed"], r["output_throughput"]) == (0, 1, 0.0)
    assert r["mean_ttft_ms"] == 0.0

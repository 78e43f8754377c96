"""`cadence launch` on every CPU kernel path this machine runs: the default picks the
best instruction set and the dtype for it and says so in /info, and serves the embedded
GGUF as it is, with this machine's kernel table and with one choosing the float copy; a
forced path serves the same greedy tokens as transformers, and a path that cannot run is
refused at start.

The forced paths serve the tiny random Llama (SmolLM2's tokenizer, head size and grouped
attention; wide logits, so no greedy choice sits within float32 rounding of another): the
kernels of each path are the point, and its steps cost a fraction of SmolLM2's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cadence import cpu_isa as isa
from invariance import PROMPTS as QUESTIONS
from invariance import assert_same_answers
from margin import QUANTIZED_BOUND, judge, served_greedy

from conftest import (
    CHAT_PROMPTS,
    LaunchedServer,
    greedy_ids,
    greedy_ids_together,
    launch,
    reference_up_to_eos,
    stop,
    tiny_model,
    together,
)

PROMPTS = 4  # of the chat prompts, 64 greedy tokens each, per kernel path
TINY_BLOCKS = 64
JUDGED = 4  # chat prompts the default's answers are judged on, 24 tokens each


@pytest.fixture(scope="module", params=["measured-table", "float-copy-table"])
def default_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedServer]:
    """The default launch with this machine's measured kernel table, and with a table
    choosing the float copy of both formats and the float KV cache: what calibration may
    measure elsewhere (on a Sapphire Rapids oneDNN's bfloat16 product runs on AMX), so
    the checks below hold whichever it chooses."""
    tmp = tmp_path_factory.mktemp("default")
    args = ["--kv-cache-memory", "128MiB"]
    if request.param == "float-copy-table":
        args += ["--kernel-table", str(_float_copy_table(tmp / "kernel_table.json"))]
    server = launch(tmp, *args)
    yield server
    assert stop(server) == 0, server.log()


def _float_copy_table(path: Path) -> Path:
    """A kernel table for this machine choosing the float copy of int4 and int8 weights
    and the dtype's own KV cache."""
    from cadence.quant import calibrate, kv_calibrate

    best = isa.resolve()
    dtype = isa.default_dtype("cpu", best)
    seconds = {calibrate.DECODE_ROWS: 1.0, calibrate.PREFILL_ROWS: 10.0}
    measured = calibrate.Measured(calibrate.FLOAT, seconds, seconds, "for the test")
    kv = isa.default_kv_cache_dtype("cpu", dtype)
    even = {kv: 1.0, "int8": 1.0}
    kv_cache = kv_calibrate.KvMeasured(kv, even, "for the test", prompt_seconds=even)
    key = calibrate.machine_key(best, dtype)
    formats = {"int4": measured, "int8": measured}
    calibrate.write(calibrate.KernelTable(key, formats, kv_cache), path)
    return path


def test_the_default_launch_runs_the_best_kernels_this_cpu_has(
    default_server, request: pytest.FixtureRequest
) -> None:
    info = httpx.get(f"{default_server.url}/info").json()
    best = isa.resolve()  # the best this CPU has, or what CADENCE_CPU_ISA holds it to
    assert info["kernels"]["isa"] == best
    assert info["model_dtype"] == isa.default_dtype("cpu", best)
    for family in ("attention", "products", "norms", "sampling"):
        assert info["kernels"][family], family
    assert best in info["kernels"]["attention"]  # the C++ paged decode of that build
    log = default_server.log()
    assert f"kernels: isa {best}; attention C++ {best}" in log  # the shard's one line
    # the KV cache measured fastest here for quantized weights (int8 or the float one)
    quantization = info["quantization"]
    choice = quantization["kv_cache_measured"].split(" ", 1)[0]
    assert choice in ("int8", isa.default_kv_cache_dtype("cpu", info["model_dtype"]))
    assert quantization["kv_cache_dtype"] == choice, quantization
    if request.node.callspec.params["default_server"] == "float-copy-table":
        # the table was read: the float copy serves every row count of both formats
        rows = quantization["quantized_max_rows"]
        assert "int4: 0 (float (" in rows and "int8: 0 (float (" in rows, rows
        assert quantization["float_copy"] == "kept", quantization


def test_the_default_launch_answers_alike_alone_in_a_crowd_and_again(default_server) -> None:
    """Batch invariance on the defaults (the GGUF's integer products, bfloat16 compute, the
    KV cache the kernel table chose): tokens and logprobs bit for bit (docs/determinism.md)."""
    assert_same_answers(default_server.url, QUESTIONS[:8], seeded=4, max_tokens=12, crowd=24)


def test_the_default_launch_serves_the_embedded_gguf_as_it_is(
    default_server, float_reference
) -> None:
    """The Q4_1 file served as it is: its answers are transformers' on the file's
    dequantized weights by the margin rule (`margin.py`), not an exact text: for the chat
    template's prompt below the float32 reference has `The` over `L` by 0.08 nat, and
    llama.cpp on the same file answers "L'Étoile"."""
    quantization = httpx.get(f"{default_server.url}/info").json()["quantization"]
    assert quantization["source"] == "gguf Q4_1"
    # the tied head in the file's Q8_0 blocks where the integer product serves
    from cadence.quant.cpu_gemm import integer_product_is_fast

    integer = integer_product_is_fast(isa.resolve())
    assert quantization["weights"] == ("int4 g32, int8 g32" if integer else "int4 g32")
    tokenizer, model = float_reference
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        for prompt in CHAT_PROMPTS[:JUDGED]
    ]
    with httpx.Client(base_url=default_server.url, timeout=120) as client:
        # served together (the default is batch-invariant), then judged one by one
        served = together(*(lambda t=t: served_greedy(client, t, 24) for t in texts))
        judgements = [judge(model, *answer) for answer in served]
        chat = {
            "messages": [{"role": "user", "content": CHAT_PROMPTS[0]}],
            "max_tokens": 16,
            "temperature": 0,
        }
        response = client.post("/v1/chat/completions", json=chat)
    assert all(j.holds(QUANTIZED_BOUND) for j in judgements), judgements
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("cpu_isa", isa.ISAS)
def test_each_kernel_path_serves_transformers_greedy_tokens(
    cpu_isa: str,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: str,
    tiny_reference: tuple[list[str], list[list[int]], int],
) -> None:
    lacking = isa.missing(cpu_isa)
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(lacking)}")
    server = launch(
        tmp_path_factory.mktemp(cpu_isa),
        *("--cpu-isa", cpu_isa, *tiny_model(tiny_llama_dir, TINY_BLOCKS)),
    )
    try:
        assert httpx.get(f"{server.url}/info").json()["kernels"]["isa"] == cpu_isa
        texts, expected, eos_id = tiny_reference
        references = [reference_up_to_eos(r, eos_id) for r in expected[:PROMPTS]]
        with httpx.Client(base_url=server.url, timeout=120) as client:
            ours = greedy_ids_together(client, texts[:PROMPTS], [len(r) for r in references])
        for text, got, reference in zip(texts[:PROMPTS], ours, references, strict=True):
            assert got == reference, (cpu_isa, text)
    finally:
        assert stop(server) == 0, server.log()


def test_without_a_compiler_it_serves_through_torch(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: str,
    tiny_reference: tuple[list[str], list[list[int]], int],
) -> None:
    """A machine with no C++ compiler (and no kernels built before): the shard serves
    through torch's attention and layers, and says so."""
    tmp = tmp_path_factory.mktemp("no-compiler")
    env = os.environ | {"CXX": "no-such-compiler", "CADENCE_KERNEL_CACHE": str(tmp / "none")}
    server = launch(tmp, *tiny_model(tiny_llama_dir, TINY_BLOCKS), env=env)
    try:
        kernels = httpx.get(f"{server.url}/info").json()["kernels"]
        assert kernels["isa"].startswith("none (no C++ compiler")
        assert (kernels["attention"], kernels["norms"], kernels["sampling"]) == (
            "torch gather + SDPA",
            "torch",
            "torch",
        )
        texts, expected, eos_id = tiny_reference
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for text, reference in list(zip(texts, expected, strict=True))[:PROMPTS]:
                reference = reference_up_to_eos(reference, eos_id)
                assert greedy_ids(client, text, len(reference)) == reference, text
    finally:
        assert stop(server) == 0, server.log()


def _launch_exit(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cadence", "launch", "--port", "0", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_an_instruction_set_that_cannot_run_is_refused_at_start(tmp_path: Path) -> None:
    unknown = _launch_exit("--cpu-isa", "avx1024")
    assert unknown.returncode == 2 and "--cpu-isa" in unknown.stderr
    for name in (n for n in isa.ISAS if isa.missing(n)):  # none on an AVX-512 BF16 CPU
        refused = _launch_exit("--cpu-isa", name)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"--cpu-isa {name}: this CPU lacks" in refused.stdout + refused.stderr
        assert "starting shard" not in refused.stdout + refused.stderr

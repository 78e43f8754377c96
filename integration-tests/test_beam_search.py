"""Beam search through `cadence launch` against transformers' `generate(num_beams=...)` in
float32 on the tiny random Llama: the same token sequences, best first, and the same scores
(cumulative logprob / length ** length_penalty) within float32 rounding, for widths 2, 4
and 8 through TGI's `/generate` (`parameters.num_beams`) and the OpenAI SDK
(`use_beam_search`); beam and ordinary requests at once on a small KV pool they contend
for; the blocks all given back; the blocks beams share in /metrics. And on the embedded
SmolLM2 (float32), chat answers whose beams end at its EOS."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from beam_reference import assert_beams_as_transformers

from conftest import CHAT_PROMPTS, LaunchedServer, launch, stop, the_shard, tiny_model, wait_for

PROMPTS = [
    # 24 tokens: its first block is full, so every beam of its searches shares it from the
    # first fork to the end (the other prompts' single partial blocks are copied at a
    # fork's first write, and their shared blocks come and go with the steps).
    "The history of the printing press, from the first carved wooden blocks of China to the "
    "movable metal type of Mainz,",
    "A recipe for bread:",
    "In the year 2050, cities will",
]
MAX_NEW = 12
# 16-token blocks: three searches 8 beams wide (each beam up to 2 blocks of its own beside
# the shared full prompt block, if any) do not fit at once.
BLOCKS = 28
# (width, length_penalty, early_stopping)
CASES = [(2, 1.0, False), (4, 0.5, True), (8, 2.0, "never")]


def metrics(url: str) -> dict[str, float]:
    """`name{labels}` -> value, labels other than `model` kept in the key."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        out[re.sub(r'model="[^"]*",?', "", key).replace("{}", "")] = float(value)
    return out


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    tmp = tmp_path_factory.mktemp("beams")
    launched = launch(tmp, *tiny_model(tiny_llama_dir, BLOCKS), "--max-batch-size", "32")
    yield launched
    stop(launched)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> dict[tuple[int, int], list[tuple[list[int], float]]]:
    """transformers' beams per (prompt, case): token ids and sequences_scores, best first."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    out = {}
    for p, prompt in enumerate(PROMPTS):
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        for c, (width, penalty, early) in enumerate(CASES):
            with torch.inference_mode():
                result = model.generate(
                    input_ids,
                    max_new_tokens=MAX_NEW,
                    do_sample=False,
                    num_beams=width,
                    num_return_sequences=width,
                    length_penalty=penalty,
                    early_stopping=early,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            beams = result.sequences[:, input_ids.shape[1] :].tolist()
            out[(p, c)] = list(zip(beams, result.sequences_scores.tolist(), strict=True))
    return out


def check_beams(
    got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], float]], penalty: float
) -> None:
    """Each returned beam against transformers': its tokens, and its score from its
    tokens' logprobs."""
    assert len(got) == len(want)
    for i, ((ids, logprobs), (ids_want, score_want)) in enumerate(zip(got, want, strict=True)):
        # The tiny Llama never ends at an EOS: every beam runs to the token limit.
        assert ids == ids_want, (i, ids, ids_want)
        score = sum(logprobs) / len(ids) ** penalty
        assert score == pytest.approx(score_want, rel=1e-3, abs=1e-3), (i, score, score_want)


def tgi_beams(
    url: str, prompt: str, width: int, penalty: float, early: Any
) -> list[tuple[list[int], list[float]]]:
    body = {
        "inputs": prompt,
        "parameters": {
            "num_beams": width,
            "length_penalty": penalty,
            "early_stopping": early,
            "max_new_tokens": MAX_NEW,
            "details": True,
        },
    }
    response = httpx.post(f"{url}/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    sequences = [details] + details.get("best_of_sequences", [])
    return [
        ([t["id"] for t in s["tokens"]], [t["logprob"] for t in s["tokens"]]) for s in sequences
    ]


def routed_requests(url: str) -> float:
    """Requests the router has handed to its batching loop (counted while the shard is
    frozen)."""
    counts = metrics(url)
    return sum(v for k, v in counts.items() if k.startswith("cadence_replica_requests_total"))


def test_tgi_beams_match_transformers_with_ordinary_requests_beside_in_a_small_pool(
    server: LaunchedServer, reference: dict[tuple[int, int], list[tuple[list[int], float]]]
) -> None:
    from text_generation import Client

    shared_seen = []
    stop_watch = threading.Event()

    def watch() -> None:
        while not stop_watch.is_set():
            shared_seen.append(metrics(server.url).get("cadence_kv_blocks_shared_by_beams", 0.0))

    watcher = threading.Thread(target=watch)
    watcher.start()
    ordinary = Client(server.url, timeout=600)
    jobs = [(p, c) for p in range(len(PROMPTS)) for c in range(len(CASES))]
    # The shard is frozen until the router holds every request: they contend for the
    # blocks on any machine (a fast one would finish early requests before the last came).
    shard, routed = the_shard(server), routed_requests(server.url)
    os.kill(shard, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(jobs) + 3) as pool:
            plain = [
                pool.submit(ordinary.generate, prompt, max_new_tokens=MAX_NEW) for prompt in PROMPTS
            ]
            beams = {
                (p, c): pool.submit(tgi_beams, server.url, PROMPTS[p], *CASES[c]) for p, c in jobs
            }
            wait_for(
                lambda: routed_requests(server.url) - routed >= len(jobs) + len(PROMPTS),
                60,
                "every request queued",
            )
            os.kill(shard, signal.SIGCONT)
            for future in plain:
                assert future.result().details.generated_tokens == MAX_NEW
            results = {job: future.result() for job, future in beams.items()}
    finally:
        os.kill(shard, signal.SIGCONT)  # a test that failed while it was frozen
    stop_watch.set()
    watcher.join()
    for (p, c), got in results.items():
        check_beams(got, reference[(p, c)], CASES[c][1])
    # Whether the small pool preempts a beam group here depends on how the searches' steps
    # interleave; router/src/tests/beams.rs preempts beam groups deterministically.
    after = metrics(server.url)
    assert max(shared_seen) > 0
    assert after["cadence_kv_blocks_used"] == 0
    assert after["cadence_kv_blocks_shared_by_beams"] == 0
    assert after["cadence_running_requests"] == 0


def test_openai_beams_match_transformers(
    server: LaunchedServer,
    reference: dict[tuple[int, int], list[tuple[list[int], float]]],
    tiny_llama_dir: str,
) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    for c, (width, penalty, early) in enumerate(CASES):
        completion = client.completions.create(
            model=model,
            prompt=PROMPTS[1],
            max_tokens=MAX_NEW,
            n=width,
            temperature=0,
            logprobs=0,
            extra_body={
                "use_beam_search": True,
                "length_penalty": penalty,
                "early_stopping": early,
            },
        )
        choices = sorted(completion.choices, key=lambda ch: ch.index)
        want = reference[(1, c)]
        assert len(choices) == len(want)
        for i, (choice, (ids_want, score_want)) in enumerate(zip(choices, want, strict=True)):
            assert choice.text == tokenizer.decode(ids_want), (c, i)
            logprobs = choice.logprobs.token_logprobs
            score = sum(logprobs) / len(logprobs) ** penalty
            assert score == pytest.approx(score_want, rel=1e-3, abs=1e-3), (c, i)


def test_smollm_beams_that_end_at_its_eos_match_transformers(
    smollm_server: LaunchedServer, float_reference: tuple[object, object]
) -> None:
    """Short chat answers, so beams end at EOS before the token limit (the tiny Llama's
    never do) and are ranked by their own lengths."""
    ended = assert_beams_as_transformers(smollm_server.url, *float_reference, CHAT_PROMPTS[:2])
    assert ended > 0, "no beam ended at EOS: the check of their ranking has no teeth"


def test_beam_requests_are_refused_with_each_apis_names(server: LaunchedServer) -> None:
    for parameters, field in [
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 2, "temperature": 0.5}, "temperature"),
        ({"num_beams": 2, "stop": ["x"]}, "stop"),
    ]:
        response = httpx.post(
            f"{server.url}/generate", json={"inputs": "hi", "parameters": parameters}
        )
        assert response.status_code == 422, response.text
        assert field in response.json()["error"]
    for body, param in [
        ({"use_beam_search": True, "n": 2, "stream": True}, "use_beam_search"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.8}, "temperature"),
        ({"use_beam_search": True, "n": 64}, "n"),
    ]:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param

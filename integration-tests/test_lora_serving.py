"""LoRA adapters served end to end: PEFT folders made here with `peft` on a tiny random
Llama's float32 weights (its heads split over two ranks as SmolLM2's do: the adapters'
slicing, not the embedded model, is the point), served by `cadence launch --lora-adapters`,
against transformers + PEFT running the same adapters (the oracle), through TGI's route
and OpenAI's client; runtime load and unload, the directory resolver, refusals, and a load
over more adapters than the KV pool can keep resident."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import LaunchedServer, launch, metrics, stop, tiny_gqa_model, tiny_model

NEW_TOKENS = 12
PROMPTS = ["The capital of France is", "def reverse(items):", "Once upon a time, a robot"]

# name -> the LoraConfig fields it is made with: ranks, targets and scalings that differ
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all4-rs": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    },
    "attn16-pattern": {
        "r": 16,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "rank_pattern": {"k_proj": 4},
        "alpha_pattern": {"o_proj": 64},
    },
    "mlp8-layers": {
        "r": 8,
        "lora_alpha": 32,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
        "layers_to_transform": [0, 3],  # of 4: skips the middle two
    },
}
LATE = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}  # loaded at run time
SIXTEEN_POOL_BLOCKS = 40
POOL_BLOCKS = 2048  # the KV pool of the servers of ADAPTERS: they and the requests fit


class AdapterMaker:
    """Makes PEFT adapters for the model in `base_dir`, loaded once (each adapter wraps a
    copy of it: PEFT injects its layers into the model it is given)."""

    def __init__(self, base_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)

    def make(self, out: Path, fields: dict[str, Any], seed: int) -> Path:
        """A PEFT adapter with random, non-trivial A and B (PEFT's init_lora_weights=False)."""
        import copy

        import torch
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = copy.deepcopy(self.base)
        peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **fields))
        peft_model.save_pretrained(out)
        return out


@pytest.fixture(scope="module")
def adapter_dirs(tiny_gqa_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    maker = AdapterMaker(tiny_gqa_dir)
    made = {
        name: maker.make(root / name, fields, seed)
        for seed, (name, fields) in enumerate(ADAPTERS.items())
    }
    lora_dir = tmp_path_factory.mktemp("lora-dir")
    made["late"] = maker.make(root / "late", LATE, 100)
    made["found"] = maker.make(lora_dir / "found", LATE, 101)
    return made


@pytest.fixture(scope="module")
def reference(tiny_gqa_dir: str, adapter_dirs: dict[str, Path]) -> dict[tuple[str, str], list[int]]:
    """transformers + PEFT's greedy tokens, per (adapter or "" for the base, prompt)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gqa_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_gqa_dir, dtype=torch.float32).eval()
    names = [*ADAPTERS, "late", "found"]
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()

    def greedy(prompt: str) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
        return out[0, ids.shape[1] :].tolist()

    expected: dict[tuple[str, str], list[int]] = {}
    for name in names:
        model.set_adapter(name)
        for prompt in PROMPTS:
            expected[(name, prompt)] = greedy(prompt)
    with model.disable_adapter():
        for prompt in PROMPTS:
            expected[("", prompt)] = greedy(prompt)
    return expected


@pytest.fixture(scope="module")
def server(
    tiny_gqa_dir: str, adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedServer]:
    listed = ",".join(f"{name}={adapter_dirs[name]}" for name in ADAPTERS)
    launched = launch(
        tmp_path_factory.mktemp("lora"),
        *tiny_gqa_model(tiny_gqa_dir, POOL_BLOCKS),
        *("--lora-adapters", listed),
        "--allow-runtime-lora",
        *("--lora-dir", str(adapter_dirs["found"].parent)),
    )
    yield launched
    assert stop(launched) == 0, launched.log()


def generate(url: str, prompt: str, adapter: str = "", tokens: int = NEW_TOKENS) -> httpx.Response:
    parameters: dict[str, Any] = {"max_new_tokens": tokens, "details": True}
    if adapter:
        parameters["adapter_id"] = adapter
    body = {"inputs": prompt, "parameters": parameters}
    return httpx.post(f"{url}/generate", json=body, timeout=300)


def greedy_ids(url: str, prompt: str, adapter: str = "", tokens: int = NEW_TOKENS) -> list[int]:
    response = generate(url, prompt, adapter, tokens)
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def test_a_batch_mixing_four_adapters_and_the_base_equals_transformers_and_peft(
    server: LaunchedServer, reference: dict[tuple[str, str], list[int]]
) -> None:
    cases = [(name, prompt) for name in ["", *ADAPTERS] for prompt in PROMPTS]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        got = list(pool.map(lambda c: greedy_ids(server.url, c[1], c[0]), cases))
    for case, ours in zip(cases, got, strict=True):
        assert ours == reference[case], case
    for name in ADAPTERS:  # the adapters change the answers: the check above has teeth
        assert any(reference[(name, p)] != reference[("", p)] for p in PROMPTS), name


def test_two_shards_serve_the_mixed_batch_as_transformers_and_peft(
    tiny_gqa_dir: str,
    adapter_dirs: dict[str, Path],
    reference: dict[tuple[str, str], list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Tensor parallelism: each rank holds its slice of every adapter (3 KV heads split
    2 + 1, as SmolLM2's are, so the q/k/v slices are uneven; the rank with one KV head has
    slabs of 16 x 64 elements per block, each holding one 384-wide rank row)."""
    listed = ",".join(f"{name}={adapter_dirs[name]}" for name in ADAPTERS)
    launched = launch(
        tmp_path_factory.mktemp("lora-tp"),
        *tiny_gqa_model(tiny_gqa_dir, POOL_BLOCKS),
        *("--num-shard", "2"),
        *("--lora-adapters", listed),
    )
    try:
        cases = [(name, prompt) for name in ["", *ADAPTERS] for prompt in PROMPTS]
        with ThreadPoolExecutor(max_workers=len(cases)) as pool:
            got = list(pool.map(lambda c: greedy_ids(launched.url, c[1], c[0]), cases))
        for case, ours in zip(cases, got, strict=True):
            assert ours == reference[case], case
    finally:
        assert stop(launched) == 0, launched.log()


def test_openai_picks_the_adapter_by_model_and_lists_it_with_its_parent(
    server: LaunchedServer, adapter_dirs: dict[str, Path]
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    models = client.models.list().data
    base = models[0]
    assert getattr(base, "parent", None) is None
    listed = {m.id: m for m in models[1:]}
    assert set(listed) == set(ADAPTERS), listed
    for name, adapter_dir in adapter_dirs.items():
        if name in ADAPTERS:
            assert listed[name].parent == base.id
            assert listed[name].root == str(adapter_dir)
    prompt = PROMPTS[0]
    completion = client.completions.create(
        model="qv8", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=1
    )
    tgi = generate(server.url, prompt, "qv8").json()
    assert completion.choices[0].text == tgi["generated_text"]
    plain = client.completions.create(
        model=base.id, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
    )
    assert plain.choices[0].text == generate(server.url, prompt).json()["generated_text"]
    assert plain.choices[0].text != completion.choices[0].text


def test_an_unknown_adapter_is_an_error_never_the_base_model(server: LaunchedServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-")
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    assert "no-such-adapter" in str(caught.value)
    response = generate(server.url, "Hi", "no-such-adapter")
    assert response.status_code == 422, response.text
    assert "adapter_id" in response.json()["error"]


def test_runtime_load_then_unload(
    server: LaunchedServer,
    adapter_dirs: dict[str, Path],
    reference: dict[tuple[str, str], list[int]],
) -> None:
    load = {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}
    response = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=120)
    assert response.status_code == 200, response.text
    for prompt in PROMPTS:
        assert greedy_ids(server.url, prompt, "late") == reference[("late", prompt)], prompt
    response = httpx.post(
        f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert generate(server.url, PROMPTS[0], "late").status_code == 422
    # and the others are untouched
    assert greedy_ids(server.url, PROMPTS[1], "qv8") == reference[("qv8", PROMPTS[1])]


def test_the_directory_resolver_loads_a_name_on_first_use(
    server: LaunchedServer, reference: dict[tuple[str, str], list[int]]
) -> None:
    for prompt in PROMPTS:
        assert greedy_ids(server.url, prompt, "found") == reference[("found", prompt)]


def test_a_bad_adapter_folder_is_refused_and_the_server_keeps_serving(
    server: LaunchedServer, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "dora"
    bad.mkdir()
    config = json.loads((adapter_dirs["qv8"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes(
        (adapter_dirs["qv8"] / "adapter_model.safetensors").read_bytes()
    )
    response = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "dora", "lora_path": str(bad)},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "dora" in response.text.lower()
    assert greedy_ids(server.url, PROMPTS[0], "qv8")  # still serving


def test_64_requests_over_16_adapters_in_a_small_pool_each_equal_their_output_alone(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Paging adapters in and out is the point, not the model: the tiny random Llama."""
    root = tmp_path_factory.mktemp("sixteen")
    names = [f"a{i}" for i in range(16)]
    maker = AdapterMaker(tiny_llama_dir)
    for i, name in enumerate(names):
        maker.make(root / name, LATE, 200 + i)
    # A pool of SIXTEEN_POOL_BLOCKS blocks: 16 resident rank-8 q/v adapters and the KV of
    # the requests in flight do not fit together, so adapters are evicted.
    launched = launch(
        tmp_path_factory.mktemp("sixteen-server"),
        *tiny_model(tiny_llama_dir, SIXTEEN_POOL_BLOCKS),
        *("--lora-dir", str(root)),
    )
    try:
        jobs = [
            (f"Request {i}: tell me about {i * 7}", names[i % 16], 8 + i % 9) for i in range(64)
        ]
        alone = [greedy_ids(launched.url, p, a, n) for p, a, n in jobs]
        with ThreadPoolExecutor(max_workers=64) as pool:
            together = list(pool.map(lambda j: greedy_ids(launched.url, *j), jobs))
        assert together == alone
        seen = metrics(launched.url)
        evictions = sum(
            v for k, v in seen.items() if k.startswith("cadence_lora_adapter_evictions_total")
        )
        assert evictions > 0, seen
        in_use = sum(
            v for k, v in seen.items() if k.startswith("cadence_lora_adapter_blocks_in_use")
        )
        assert in_use == 0, seen
    finally:
        assert stop(launched) == 0, launched.log()

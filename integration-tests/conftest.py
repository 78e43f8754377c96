"""Fixtures that launch the real stack (`cadence launch`: shard + router) on a free port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cadence.model_source import default_model_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LaunchedServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


# float32 weights and KV cache (by default the cache is bfloat16 under float32 weights on
# CPU): the tests that compare against transformers in float32 pin both
FLOAT32 = ("--dtype", "float32", "--kv-cache-dtype", "float32")


def smollm_float_copy() -> Path:
    """Where the embedded GGUF's float32 copy is made: beside the folder serving the GGUF."""
    served = default_model_dir()
    return served.with_name(f"{served.name}-float32")


# The embedded SmolLM2 with its GGUF's weights dequantized into float32, and a float32 KV
# cache: what the tests that compare token for token with transformers serve. (Served as
# it is, its int4 products compute in bfloat16: test_cpu_paths checks that default.)
SMOLLM_FLOAT32 = ("--model-id", str(smollm_float_copy()), *FLOAT32)


def launch(
    tmp_dir: Path,
    *args: str,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    port: int | None = None,
    trust: ssl.SSLContext | None = None,
) -> LaunchedServer:
    """Starts `cadence launch` (in `env`, default this process's environment; on `port`,
    default a free one) and waits until its router answers /ready: over HTTPS at
    https://localhost when `trust` (which verifies its certificate) is given."""
    port = port or free_port()
    url = f"https://localhost:{port}" if trust else f"http://127.0.0.1:{port}"
    log_path = tmp_dir / f"launch-{port}.log"
    log_file = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence", "launch", "--port", str(port), *args],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    server = LaunchedServer(url, process, log_path)
    deadline = time.monotonic() + timeout
    # One client for every poll: `httpx.get` builds a client, and with it an SSL context
    # from certifi's bundle, each time (60 ms of CPU on a 2-core Zen 3, taken from the
    # warm-up it waits for: a SmolLM2 float32 launch took 11.0 s polled so, 9.0 s so).
    with httpx.Client(timeout=2, verify=trust or True) as poll:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"cadence launch exited with {process.returncode}:\n{server.log()}"
                )
            try:
                ready = poll.get(f"{server.url}/ready")
                if ready.status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a launch takes 3-12 s; a coarser poll adds its half to each
    stop(server)
    raise TimeoutError(f"cadence launch not ready after {timeout}s:\n{server.log()}")


def stop(server: LaunchedServer) -> int:
    """SIGTERM, as an orchestrator would; returns the launcher's exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
    return server.process.returncode


def shard_pids(launcher: subprocess.Popen) -> list[int]:
    """The processes the launcher started as `python -m cadence serve` (its shards)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # after the command's name
        if parent == launcher.pid and argv[1:4] == [b"-m", b"cadence", b"serve"]:
            pids.append(int(entry.name))
    return pids


def the_shard(server: LaunchedServer) -> int:
    (pid,) = shard_pids(server.process)
    return pid


def prometheus_samples(text: str) -> dict[str, float]:
    """`name{labels}` → value, for every sample line of a Prometheus text exposition."""
    line = re.compile(r"^([a-zA-Z_:][\w:]*\{[^}]*\}) (\S+)$", re.MULTILINE)
    return {key: float(value) for key, value in line.findall(text)}


def metrics(url: str) -> dict[str, float]:
    """The server's `/metrics` now, by `name{labels}`."""
    return prometheus_samples(httpx.get(f"{url}/metrics", timeout=10).text)


def wait_for(happened: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls `happened` until true; the seconds it took."""
    started = time.monotonic()
    while not happened():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.fixture(scope="session")
def smollm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    """The embedded SmolLM2-135M-Instruct in float32 (its GGUF's float copy)."""
    tmp = tmp_path_factory.mktemp("smollm")
    # The name its clients send: OpenAI's and Anthropic's routes answer 404 to any other.
    server = launch(
        tmp, *SMOLLM_FLOAT32, "--kv-cache-memory", "512MiB", "--served-model-name", "smollm"
    )
    yield server
    code = stop(server)
    assert code == 0, f"launcher exited with {code} on SIGTERM:\n{server.log()}"


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The folder `cadence launch` serves the embedded GGUF from (config, tokenizer,
    weights.gguf)."""
    from cadence.model_source import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session", autouse=True)
def smollm_float_dir(smollm_dir: str) -> str:
    """The embedded GGUF's weights dequantized into float32 safetensors (SMOLLM_FLOAT32's
    folder, and transformers' reference): the values its int4 weights stand for, exactly."""
    from cadence.convert import convert_gguf
    from cadence.quant.checkpoints import GGUF_WEIGHTS

    return str(convert_gguf(Path(smollm_dir) / GGUF_WEIGHTS, smollm_float_copy()))


# A random Llama with SmolLM2's tokenizer and chat template, for the tests where the
# scheduler, the HTTP layer or operations are the point rather than the embedded model: a
# step costs a fraction of SmolLM2-135M's, so the same checks run in much less time.
TINY_LAYERS, TINY_KV_HEADS, TINY_HEAD_DIM = 2, 1, 64
TINY_BLOCK_BYTES_FLOAT32 = TINY_LAYERS * 2 * TINY_KV_HEADS * TINY_HEAD_DIM * 16 * 4


def tiny_sizes(source: dict[str, Any]) -> dict[str, Any]:
    """The tiny test models' shape (every family's), with SmolLM2's special token ids."""
    return {
        "hidden_size": TINY_KV_HEADS * 4 * TINY_HEAD_DIM,
        "intermediate_size": 512,
        "num_hidden_layers": TINY_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": TINY_KV_HEADS,
        "head_dim": TINY_HEAD_DIM,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "bos_token_id": source["bos_token_id"],
        "eos_token_id": source["eos_token_id"],
        "pad_token_id": source["pad_token_id"],
    }


def draw_wide_weights(model: Any) -> None:
    """Redraws every matrix wide (embeddings 0.5, the rest 0.08), so greedy choices are
    rarely within float32 rounding of the runner-up."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 if "embed" in name else 0.08)


def tiny_model(tiny_llama_dir: str, blocks: int) -> tuple[str, ...]:
    """`cadence launch` flags serving the tiny Llama in float32 with a KV cache of
    `blocks` blocks."""
    memory = str(blocks * TINY_BLOCK_BYTES_FLOAT32)
    return ("--model-id", tiny_llama_dir, *FLOAT32, "--kv-cache-memory", memory)


def save_wide_llama(path: Path, smollm_dir: str, seed: int, **sizes: int) -> str:
    """A random Llama with SmolLM2's vocabulary, tokenizer and chat template saved in
    `path`: the tiny sizes (tiny_sizes) with `sizes` over them, tied embeddings drawn wide
    (draw_wide_weights) from `seed`, the special tokens' rows zero."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = json.loads((Path(smollm_dir) / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=source["vocab_size"], tie_word_embeddings=True, **(tiny_sizes(source) | sizes)
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    draw_wide_weights(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[:3] = 0  # <|endoftext|>, <|im_start|>, <|im_end|>
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm_dir) / name, path / name)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: str) -> str:
    """The tiny random Llama's folder (config, safetensors, SmolLM2's tokenizer files).

    Its weights are drawn wide (logits with a standard deviation of ~8), so a greedy
    choice is rarely within float32 rounding of the runner-up, and the special tokens'
    rows are zero: their logit is 0 where the top one is far above, so random text never
    ends early at an EOS and a request runs to its token limit."""
    return save_wide_llama(tmp_path_factory.mktemp("tiny-llama"), smollm_dir, seed=0)


# A random Llama whose heads split over two ranks as SmolLM2's do (6 query heads over 3 KV
# heads: 2 + 1 KV heads a rank), for the tensor-parallel and LoRA tests where the split,
# not the embedded model, is the point: about a sixth of SmolLM2's weights.
GQA_LAYERS, GQA_HEADS, GQA_KV_HEADS = 4, 6, 3
GQA_BLOCK_BYTES_FLOAT32 = GQA_LAYERS * 2 * GQA_KV_HEADS * TINY_HEAD_DIM * 16 * 4


def tiny_gqa_model(tiny_gqa_dir: str, blocks: int) -> tuple[str, ...]:
    """`cadence launch` flags serving the tiny GQA Llama in float32 with a KV cache of
    `blocks` blocks."""
    memory = str(blocks * GQA_BLOCK_BYTES_FLOAT32)
    return ("--model-id", tiny_gqa_dir, *FLOAT32, "--kv-cache-memory", memory)


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: str) -> str:
    """The tiny GQA Llama's folder: the tiny Llama's recipe at GQA_LAYERS layers of
    GQA_HEADS query heads over GQA_KV_HEADS."""
    return save_wide_llama(
        tmp_path_factory.mktemp("tiny-gqa"),
        smollm_dir,
        seed=1,
        hidden_size=GQA_HEADS * TINY_HEAD_DIM,
        num_hidden_layers=GQA_LAYERS,
        num_attention_heads=GQA_HEADS,
        num_key_value_heads=GQA_KV_HEADS,
    )


@pytest.fixture
def client(smollm_server: LaunchedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=smollm_server.url, timeout=300) as http:
        yield http


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a short motivational quote.",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 64


def greedy_ids(
    client: httpx.Client, text: str, max_new_tokens: int, grammar: dict | None = None
) -> list[int]:
    """TGI's /generate greedy token ids (under `grammar`, TGI's structured-output field)."""
    parameters: dict[str, Any] = {"max_new_tokens": max_new_tokens, "details": True}
    if grammar is not None:
        parameters["grammar"] = grammar
    response = client.post("/generate", json={"inputs": text, "parameters": parameters})
    assert response.status_code == 200, (text, grammar, response.text)
    return [token["id"] for token in response.json()["details"]["tokens"]]


def greedy_ids_together(
    client: httpx.Client,
    texts: Sequence[str],
    max_new_tokens: int | Sequence[int],
    grammars: Sequence[dict | None] | None = None,
) -> list[list[int]]:
    """`greedy_ids` of every text (each its own length, or one for all; each under its
    grammar, if given), the requests sent at once: the server decodes them in one batch,
    in a fraction of the steps one at a time takes. Every server these tests compare this
    way is batch-invariant (test_determinism and its kin probe that), so each answer is
    what it would be alone."""
    lengths = [max_new_tokens] * len(texts) if isinstance(max_new_tokens, int) else max_new_tokens
    jobs = list(zip(texts, lengths, grammars or [None] * len(texts), strict=True))
    with ThreadPoolExecutor(max(1, len(jobs))) as pool:
        return list(pool.map(lambda job: greedy_ids(client, *job), jobs))


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Each call's result, the calls made at once: requests to one server are then decoded
    in one batch instead of one after another. For servers that are batch-invariant
    (float32, the deterministic default: test_determinism probes it), so every answer is
    the one it gets alone."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


@pytest.fixture(scope="session")
def float_reference(smollm_float_dir: str) -> tuple[object, object]:
    """transformers' tokenizer and float32 model on the embedded GGUF's dequantized weights:
    the oracle for the embedded model however it is served."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_float_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm_float_dir, dtype=torch.float32).eval()
    return tokenizer, model


def greedy_reference(
    tokenizer: Any,
    model: Any,
    prompts: Sequence[str] = CHAT_PROMPTS,
    new_tokens: int = NEW_TOKENS,
) -> tuple[list[str], list[list[int]], int]:
    """`prompts` rendered with the model's chat template, and transformers' greedy
    continuations of `new_tokens` from `model`."""
    import torch

    texts, outputs = [], []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        input_ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            generated = model.generate(
                input_ids, max_new_tokens=new_tokens, do_sample=False, num_beams=1
            )
        texts.append(text)
        outputs.append(generated[0, input_ids.shape[1] :].tolist())
    return texts, outputs, tokenizer.eos_token_id


@pytest.fixture(scope="session")
def transformers_reference(
    float_reference: tuple[object, object],
) -> tuple[list[str], list[list[int]], int]:
    """Chat prompts rendered with the model's template, and transformers' greedy continuations."""
    return greedy_reference(*float_reference)


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_dir: str) -> tuple[list[str], list[list[int]], int]:
    """The same for the tiny random Llama (its special tokens' rows are zero, so no
    continuation ends early)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return greedy_reference(tokenizer, model)


def reference_up_to_eos(reference: list[int], eos_id: int) -> list[int]:
    """A reference continuation cut after its EOS, as the server stops there."""
    return reference[: reference.index(eos_id) + 1] if eos_id in reference else reference


# A Qwen3-Thinking-style template: the assistant's turn opens `<think>` unless
# `enable_thinking` is false, when it writes the empty block (Qwen3's switch).
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
THINKING_QUESTION = "What is 12 times 7?"
THINKING_TOKENS = 12  # the tokens the reasoning tests generate


def thinking_prompt(tokenizer: Any, enable_thinking: bool) -> str:
    """THINKING_QUESTION rendered by the tiny Qwen3's template."""
    messages = [{"role": "user", "content": THINKING_QUESTION}]
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: str) -> str:
    """A tiny random Qwen3 (the tiny Llama's sizes, per-head q/k norms, a separate LM head)
    with SmolLM2's tokenizer plus `<think>` and `</think>` as added tokens (as Qwen3's
    are) and THINKING_TEMPLATE.

    Random text never closes its reasoning by itself, so the LM head's `</think>` row is
    the row of the token the model picks a few steps into its answer to the thinking
    prompt, scaled up: there `</think>` wins instead, and the output is reasoning, the
    tag, then more text (checked here with transformers' greedy output)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    source = json.loads((Path(smollm_dir) / "config.json").read_text())
    config = Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=False, **tiny_sizes(source))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    lm_head = model.lm_head.weight
    draw_wide_weights(model)
    with torch.no_grad():
        lm_head[:3] = 0  # <|endoftext|>, <|im_start|>, <|im_end|>: never top
        lm_head[open_id] = 0
    ids = tokenizer(thinking_prompt(tokenizer, True), return_tensors="pt").input_ids

    def greedy() -> list[int]:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=THINKING_TOKENS, do_sample=False)
        return out[0, ids.shape[1] :].tolist()

    plain = greedy()
    for step in range(4, THINKING_TOKENS - 3):
        with torch.no_grad():
            lm_head[close_id] = lm_head[plain[step]] * 1.05
        out = greedy()
        if close_id in out and 2 <= out.index(close_id) <= THINKING_TOKENS - 3:
            break
    else:
        raise AssertionError(f"no step of {plain} closes the reasoning")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)

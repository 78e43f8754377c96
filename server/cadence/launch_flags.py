"""The flags of `cadence launch`, grouped by concern for --help, with vLLM's names as
aliases; and the shard flags `cadence serve` shares with it.

A flag's default is the default of the config dataclass's field of the same name
(`cadence.config`); a flag the launcher forwards to the router shows the router's own
default. An alias sets the same field as cadence's name (`--help` shows both).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from cadence.config import (
    ATTENTION_BACKENDS,
    GROUP_SIZES,
    KEEP_FLOAT_CHOICES,
    QUANTIZE_METHODS,
    REASONING_PARSERS,
    SPECULATIVE_METHODS,
    LaunchConfig,
    default_of,
)
from cadence.flags import (
    Container,
    TrackedToggle,
    add_flag,
    add_switch,
    add_toggle,
    env_name,
    parse_size,
    record,
)
from cadence.kv_dtypes import KV_CACHE_DTYPES
from cadence.logs import LOG_FORMATS
from cadence.shard.kv_budget import DEFAULT_FRACTION
from cadence.vllm_flags import LoraModules, SpeculativeConfig, lora_module, speculative_settings

Add = Callable[..., None]
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
MODEL_DTYPE_CHOICES = ("auto", *DTYPE_CHOICES)
CPU_ISA_CHOICES = ("auto", "avx512_bf16", "avx512", "avx2", "scalar")
# vLLM's spellings of the same dtypes.
_DTYPE_NAMES = {"half": "float16", "float": "float32"}
_KV_DTYPE_NAMES = {"fp8": "fp8_e4m3"}  # vLLM's fp8 cache is e4m3 on GPUs
# Pre-quantized checkpoints vLLM names with --quantization: cadence detects them.
_DETECTED_QUANTIZATIONS = ("awq", "gptq", "awq_marlin", "gptq_marlin", "gguf")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def dtype_name(text: str) -> str:
    return _DTYPE_NAMES.get(text, text)


def kv_dtype_name(text: str) -> str:
    return _KV_DTYPE_NAMES.get(text, text)


def quantize_method(text: str) -> str:
    if text in _DETECTED_QUANTIZATIONS:
        raise argparse.ArgumentTypeError(
            f"{text} checkpoints are detected from the model folder and need no flag; "
            f"--quantize quantizes a float checkpoint at load: {list(QUANTIZE_METHODS)}"
        )
    return text


class PositionalModel(argparse.Action):
    """`cadence launch MODEL`, vLLM's spelling of --model-id MODEL."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        record(parser, namespace, "model_id", "MODEL", values)


def adder(container: Container, config: type, shown: dict[str, str] | None = None) -> Add:
    """`add_flag` on `container`, each flag defaulting to the default of `config`'s field
    of the same name; `shown`: the defaults another program applies (the router), for
    --help."""
    defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
    shown = shown or {}

    def add(flag: str, *aliases: str, **kwargs: Any) -> None:
        kwargs.setdefault("default", defaults.get(flag.lstrip("-").replace("-", "_")))
        add_flag(container, flag, *aliases, shown_default=shown.get(flag), **kwargs)

    return add


def add_log_format(add: Add) -> None:
    add("--log-format", choices=LOG_FORMATS, help="Logs are written as text or as JSON lines.")


def add_model_flags(add: Add) -> None:
    """How the weights are loaded (each shard's)."""
    add(
        "--dtype",
        type=dtype_name,
        choices=MODEL_DTYPE_CHOICES,
        help="Weights and activations use this dtype (vLLM's half and float are accepted); "
        "auto is bfloat16 on a GPU and on CPUs with AVX-512 BF16, and float32 on other CPUs, "
        "where it is the faster.",
    )
    add(
        "--quantize",
        "--quantization",
        "-q",
        type=quantize_method,
        choices=QUANTIZE_METHODS,
        help="Quantize a float checkpoint's linear weights at load: int8 per output channel "
        "or int4 per group, the LM head in int8 either way. Pre-quantized GPTQ and AWQ "
        "folders and GGUF files are detected without it.",
    )
    add(
        "--quantize-group-size",
        type=int,
        choices=GROUP_SIZES,
        help="The int4 quantization groups this many input columns; a layer whose input it does "
        "not divide takes the largest smaller power of two that does, down to 32. 32 costs 1 bit "
        "per weight more than 128 for no measurable speed and is the most accurate "
        "(docs/quantization.md).",
    )
    add(
        "--quantize-keep-float",
        choices=KEEP_FLOAT_CHOICES,
        help="Keep a float copy of each quantized weight for products of more rows than the "
        "quantized kernels win at (prefill), at the cost of its memory; auto keeps them on "
        "CPU while the copies fit in half the available memory, and never on a GPU.",
    )
    add(
        "--kernel-table",
        help="Which kernel multiplies quantized weights (the integer product or a float copy "
        "through oneDNN), as `cadence calibrate` measured it; unset, `cadence launch` "
        "measures it on its first start on a CPU and caches it per CPU model "
        "(docs/quantization.md).",
    )


def add_kv_flags(add: Add) -> None:
    """The KV cache's layout (each shard's)."""
    add(
        "--kv-cache-dtype",
        type=kv_dtype_name,
        choices=KV_CACHE_DTYPES,
        help="The KV cache is stored in this dtype, by default bfloat16 under float32 weights on "
        "CPU and --dtype otherwise, except that quantized weights on CPU take int8 where the "
        "kernel table measured it decoding faster (cadence calibrate). int8 keeps a scale per "
        "token and KV head; fp8_e4m3 (vLLM's "
        "fp8) and fp8_e5m2 keep a scale per layer for keys and for values, from --kv-cache-scales "
        "or estimated at warm-up (docs/quantization.md).",
    )
    add(
        "--kv-cache-scales",
        help="An fp8 KV cache reads its scales (stored = value / scale) from this JSON file, "
        '{"k_scale": [one per layer], "v_scale": [...]}; without it they are estimated at '
        "warm-up from a float-cache forward.",
    )
    add("--block-size", type=positive_int, help="Each KV cache block holds this many tokens.")


def add_device_flags(add: Add, container: Container, config: type) -> None:
    """Where and with which kernels the shards compute."""
    add("--device", help="The shards compute on this device: cpu, cuda or cuda:N.")
    add(
        "--cpu-isa",
        choices=CPU_ISA_CHOICES,
        help="The C++ CPU kernels use this instruction set (auto: the best this CPU has); "
        "naming one the CPU lacks is an error at start.",
    )
    add(
        "--attention-backend",
        type=str.lower,
        choices=ATTENTION_BACKENDS,
        help="Attention runs on these kernels; auto is triton on a GPU, the C++ kernels on CPU "
        "when they build, and torch otherwise.",
    )
    add_toggle(
        container,
        "--cpu-kernels",
        default=default_of(config, "cpu_kernels"),
        help="Serve through the C++ CPU kernels where they apply (off: torch everywhere).",
    )
    add_toggle(
        container,
        "--huge-pages",
        default=default_of(config, "huge_pages"),
        help="On CPU, hold the KV cache and the packed weights on 2 MB pages (transparent "
        "huge pages, asked for with madvise): fewer TLB misses in every step.",
    )
    add_toggle(
        container,
        "--deterministic",
        default=default_of(config, "deterministic"),
        help="The same request gets the same tokens and logprobs whatever else is in its "
        "step, however its prompt was chunked, and after a prefix-cache hit or a "
        "preemption (docs/determinism.md); on CPU with the C++ kernels, /info says "
        "whether it holds. Off: prefill attention and products pick their fastest "
        "kernel by row count.",
    )


def add_draft_flags(add: Add) -> None:
    """The shards' side of speculative decoding."""
    add(
        "--draft-model-id",
        help="--speculative draft drafts with this model: a local folder or .gguf file of a "
        "smaller model with the target's tokenizer, run on the same device. It proposes the "
        "next tokens and the target verifies them in one forward; its KV cache shares the "
        "target's blocks (each block holds both), so the KV memory holds fewer tokens.",
    )
    add(
        "--draft-quantize",
        choices=QUANTIZE_METHODS,
        help="Quantize the draft model's linear weights at load, as --quantize does the "
        "target's (with the target's own folder as the draft: its int8 or int4 twin).",
    )
    add(
        "--speculative-acceptance",
        type=probability,
        help="For benchmarking only, with --speculative synthetic: the chance that each "
        "proposal (after accepted ones) is accepted; the output is then NOT the model's.",
    )


def add_launch_flags(p: argparse.ArgumentParser, shown: dict[str, str]) -> None:
    """Every flag of `cadence launch`, in --help's groups."""

    def group(title: str, description: str) -> tuple[argparse._ArgumentGroup, Add]:  # noqa: SLF001
        container = p.add_argument_group(title, description)
        return container, adder(container, LaunchConfig, shown)

    g, add = group("model", "What is served and how its weights are loaded.")
    g.add_argument(
        "model",
        nargs="?",
        action=PositionalModel,
        default=argparse.SUPPRESS,
        help="The model, as `vllm serve MODEL` takes it: the same as --model-id.",
    )
    add(
        "--model-id",
        "--model",
        help="Serve this model: a local folder, a .gguf file or a Hub id (default: the "
        "embedded SmolLM2-135M).",
    )
    add_model_flags(add)
    add(
        "--chat-template",
        help="Use this chat template instead of the model's (its tokenizer_config.json's): a "
        "Jinja file, or the template itself.",
    )
    add(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="Split a thinking model's <think>…</think> reasoning from its answer into the "
        "APIs' reasoning fields (chat's `reasoning`, Anthropic's thinking blocks, Responses' "
        "reasoning items).",
    )
    _, add = group("memory and batching", "The KV cache's size and layout, and a step's size.")
    _add_memory_flags(add)
    g, add = group("scheduling", "When requests run, wait, are preempted or refused.")
    _add_scheduling_flags(g, add)
    g, add = group("API and auth", "The HTTP server: address, keys, names and request limits.")
    _add_api_flags(g, add)
    g, add = group("observability", "Logs, traces and debugging checks.")
    _add_observability_flags(g, add)
    g, add = group("LoRA", "LoRA adapters served beside the base model (docs/lora.md).")
    _add_lora_flags(g, add)
    g, add = group("speculation", "Speculative decoding (docs/speculative.md).")
    _add_speculative_flags(g, add)
    g, add = group("deployment and processes", "Devices, shard processes, start and stop.")
    _add_deployment_flags(g, add)


def _add_memory_flags(add: Add) -> None:
    add(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        type=parse_size,
        help="The KV cache takes this much memory, in bytes or with a unit such as 512MiB.",
    )
    add(
        "--memory-fraction",
        "--gpu-memory-utilization",
        type=fraction,
        help="Each shard may use this share of memory when --kv-cache-memory is unset; the KV "
        "cache gets what the profiled step leaves. On a GPU it is of the device's TOTAL "
        "memory, for everything the shard holds there: weights, activations, CUDA's own "
        f"allocations and KV cache (default {DEFAULT_FRACTION['cuda']}). On CPU it is of "
        "MemAvailable once the weights are loaded, split between the shards, for activations "
        f"and KV cache (default {DEFAULT_FRACTION['cpu']}).",
    )
    add_kv_flags(add)
    add(
        "--max-batch-tokens",
        "--max-num-batched-tokens",
        type=positive_int,
        help="A step computes at most this many tokens.",
    )
    add(
        "--max-batch-size",
        "--max-num-seqs",
        type=positive_int,
        help="A step holds at most this many requests.",
    )
    add(
        "--max-input-tokens",
        type=positive_int,
        help="A prompt may hold at most this many tokens.",
    )
    add(
        "--max-total-tokens",
        "--max-model-len",
        type=positive_int,
        help="A request's prompt and generation together may hold at most this many tokens.",
    )
    add(
        "--preemption",
        choices=("recompute", "swap"),
        help="When KV blocks run out, a victim request is recomputed later or swapped to "
        "host memory.",
    )
    add(
        "--swap-blocks",
        type=non_negative_int,
        help="--preemption swap keeps this many blocks in host memory (default: 4 x the KV "
        "cache blocks).",
    )


def _add_scheduling_flags(g: Container, add: Add) -> None:
    add(
        "--max-prefill-chunk",
        type=non_negative_int,
        help="A request computes at most this many prompt tokens per step (0: up to "
        "--max-batch-tokens).",
    )
    add_switch(g, "--no-prefix-caching", help="Turn prefix caching off.")
    g.add_argument(
        "--enable-prefix-caching",
        dest="no_prefix_caching",
        action=TrackedToggle,
        inverted=True,
        default=argparse.SUPPRESS,
        help="vLLM's names turn prefix caching on (the default) and off (as --no-prefix-caching "
        "does). "
        f"[env: {env_name('--no-prefix-caching')}]",
    )
    add(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        help="Schedule and send each step while the previous one runs (auto, the default, "
        "is on, on every device); off makes the shards wait for the router between steps.",
    )
    add(
        "--batching",
        choices=("continuous", "dynamic", "static", "none"),
        help="The batching mode decides when waiting requests join the running batch.",
    )
    add(
        "--batch-timeout-ms",
        type=non_negative_int,
        help="Dynamic batching waits at most this long for a batch to fill.",
    )
    add(
        "--scheduling-policy",
        choices=("fcfs", "fair", "priority"),
        help="Who joins the batch first and who is preempted: fcfs (arrival order), fair "
        "(between the API keys' tenants, by the Virtual Token Counter) or priority (the "
        "requests' `priority` field, lower first, aged by one level a second). See "
        "docs/tenancy.md.",
    )
    add(
        "--objective-priorities",
        help="Under --scheduling-policy priority, a request without `priority` whose "
        "x-gateway-inference-objective header names one of these objectives (NAME=P, "
        "comma-separated) runs at its priority.",
    )
    add(
        "--max-waiting-requests",
        type=positive_int,
        help="At most this many requests wait for their first step; beyond it they get 429.",
    )
    add(
        "--max-concurrent-requests",
        type=positive_int,
        help="At most this many requests are in flight; beyond it they get 429.",
    )
    add(
        "--grammar-compile-timeout-ms",
        type=positive_int,
        help="A request's grammar (JSON schema, regex, choice, tools) may take this long to "
        "compile; past it that request fails alone.",
    )
    add_switch(
        g,
        "--no-grammar-fast-forward",
        help="Sample every constrained token instead of appending the tokens a grammar forces.",
    )


def _add_api_flags(g: Container, add: Add) -> None:
    add("--hostname", "--host", help="The HTTP server binds this address.")
    add(
        "--port",
        type=int,
        help="The HTTP server binds this port, which is checked before the model loads.",
    )
    add(
        "--ssl-certfile",
        help="Serve HTTPS with this PEM certificate chain (the server's certificate first); "
        "needs --ssl-keyfile.",
    )
    add("--ssl-keyfile", help="The PEM private key of --ssl-certfile's certificate.")
    add(
        "--served-model-name",
        help="The model's names, comma-separated: each is listed by /v1/models and accepted as "
        "a request's model (another name is a 404 on the OpenAI and Anthropic routes); the first "
        "is the one answers and the metrics' labels report (default: the model id).",
    )
    add(
        "--api-key",
        help="Require Authorization: Bearer KEY; several keys are comma-separated.",
    )
    add(
        "--api-key-file",
        help="Accept the API keys of this file, one per line: KEY [TENANT] [OPTION=VALUE ...] "
        "(options tokens_per_minute, weight, role=admin); it is read again on SIGHUP and when "
        "it changes.",
    )
    add(
        "--max-concurrent-requests-per-key",
        type=positive_int,
        help="A tenant (API key account) has at most this many requests in flight; beyond it "
        "they get 429.",
    )
    add(
        "--max-tokens-per-minute-per-key",
        type=positive_int,
        help="A tenant may use this many tokens (prompt and generated) a minute; beyond it "
        "its requests get 429 with the seconds to wait (a key file's tokens_per_minute=N "
        "overrides it).",
    )
    add(
        "--cors-allow-origin",
        help="Allow these CORS origins, comma-separated, or * for any.",
    )
    add(
        "--cors-allow-headers",
        help="Allow these request headers in CORS preflights, comma-separated (default: the "
        "headers a preflight asks for, so the OpenAI and Anthropic browser SDKs get through).",
    )
    add(
        "--cors-allow-methods",
        help="Allow these methods in CORS preflights, comma-separated, or * for any "
        "(default: GET and POST).",
    )
    add("--payload-limit", type=parse_size, help="A request body may be at most this large.")
    add("--max-stop-sequences", type=int, help="A request may give at most this many stops.")
    add(
        "--max-top-n-tokens",
        "--max-logprobs",
        type=int,
        help="A request may ask for at most this many alternatives per token.",
    )
    add(
        "--max-best-of",
        type=positive_int,
        help="A request may ask for at most this many samples per prompt (n).",
    )


def _add_observability_flags(g: Container, add: Add) -> None:
    add_log_format(add)
    add(
        "--otlp-endpoint",
        help="The router exports each request's trace to this OpenTelemetry collector's "
        "OTLP/HTTP base URL, e.g. http://localhost:4318 (default: "
        "$OTEL_EXPORTER_OTLP_ENDPOINT; with neither there are no traces).",
    )
    add("--otlp-service-name", help="The exported traces carry this service.name.")
    add_switch(
        g,
        "--check-rank-agreement",
        help="For debugging, the router checks that every shard answers each step identically.",
    )


def _add_lora_flags(g: Container, add: Add) -> None:
    add(
        "--lora-adapters",
        help="Load these LoRA adapters at start, comma-separated name=path (PEFT folders); "
        "requests name them in OpenAI's model or TGI's parameters.adapter_id. One the shards "
        "refuse stops the start, with their reason.",
    )
    g.add_argument(
        "--lora-modules",
        dest="lora_adapters",
        nargs="+",
        type=lora_module,
        action=LoraModules,
        default=argparse.SUPPRESS,
        metavar="NAME=PATH",
        help='vLLM\'s spelling of --lora-adapters: space-separated name=path or {"name": ..., '
        f'"path": ...}} items. [env: {env_name("--lora-adapters")}]',
    )
    add_switch(
        g,
        "--enable-lora",
        help="Accepted for vLLM's command lines and changes nothing: LoRA is on whenever "
        "adapters are given (--lora-adapters, --lora-dir or --allow-runtime-lora).",
    )
    add(
        "--lora-dir",
        help="Find LoRA adapters in this folder: a request naming an unknown adapter N gets the "
        "one in DIR/N (with its adapter_config.json), loaded on first use.",
    )
    add(
        "--max-cpu-adapters",
        "--max-cpu-loras",
        type=positive_int,
        help="The shards keep at most this many adapters parsed in host memory; past it the "
        "least recently used one that no request uses and no KV pool holds is dropped "
        "(and loaded again when named).",
    )
    add(
        "--max-adapters-per-batch",
        "--max-loras",
        type=positive_int,
        help="A step holds at most this many distinct adapters; requests for another wait.",
    )
    add_switch(
        g,
        "--allow-runtime-lora",
        help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes); "
        "without it they are 404.",
    )


def _add_speculative_flags(g: Container, add: Add) -> None:
    add(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="Decode speculatively with this method: tokens proposed for a request are verified "
        "in the target's forward, exactly (the output is the one without it). ngram looks "
        "proposals up in the request's own tokens; draft drafts them by --draft-model-id on each "
        "shard; synthetic, for benchmarking only, accepts arbitrary proposals at "
        "--speculative-acceptance. It is off for requests with n > 1, a grammar or prompt "
        "logprobs, for steps past --speculative-max-step-tokens, and by default.",
    )
    g.add_argument(
        "--speculative-config",
        type=speculative_settings,
        action=SpeculativeConfig,
        default=argparse.SUPPRESS,
        metavar="JSON",
        help='vLLM\'s JSON form of these flags: {"method": "ngram", "num_speculative_tokens": '
        'N, "prompt_lookup_min": N, "prompt_lookup_max": N} or {"model": DRAFT, '
        '"num_speculative_tokens": N}. [env: CADENCE_SPECULATIVE and the others\' twins]',
    )
    add(
        "--num-speculative-tokens",
        type=positive_int,
        help="At most this many tokens are proposed for one request in one step (fewer while "
        "its proposals are rarely accepted).",
    )
    add(
        "--ngram-min",
        type=positive_int,
        help="With --speculative ngram, the shortest suffix of a request's tokens looked up "
        "earlier in them.",
    )
    add(
        "--ngram-max",
        type=positive_int,
        help="With --speculative ngram, the longest suffix looked up (the longest match proposes).",
    )
    add(
        "--speculative-max-step-tokens",
        type=non_negative_int,
        help="Proposals are added to a step only while it holds at most this many tokens, "
        "past which verifying them costs more than they save (0: the shards' threshold, "
        "measured by `cadence bench`, or their device's default).",
    )
    add_draft_flags(add)


def _add_deployment_flags(g: Container, add: Add) -> None:
    add_device_flags(add, g, LaunchConfig)
    add(
        "--num-shard",
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        help="Split the model over this many tensor-parallel shards, processes that each hold 1/N "
        "of every layer (torch.distributed: gloo on CPU, NCCL on GPU).",
    )
    add(
        "--replicas",
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        help="Serve this many independent copies of the model (each --num-shard processes with "
        "its own KV cache) behind one router, which sends each request to the least loaded one or "
        "to the one that caches its prompt prefix; on CPU each gets its own share of the cores "
        "and the KV memory is split between them.",
    )
    add(
        "--master-port",
        type=int,
        help="The shards meet for torch.distributed on this port (default: a free one).",
    )
    add(
        "--uds-dir",
        help="The shards' unix sockets go in this folder (default: a fresh temporary one).",
    )
    add(
        "--startup-timeout",
        type=float,
        help="Each start step (the shards loading, the router warming them up) may take this "
        "many seconds.",
    )
    add(
        "--ready-stall-timeout-ms",
        type=positive_int,
        help="/ready turns red when a step has been awaited this long and the shards do not "
        "answer their health check within 1 s.",
    )
    add(
        "--shutdown-timeout",
        type=non_negative_int,
        help="After SIGTERM the requests in flight get this many seconds to finish (new ones "
        "get 503); then they end with an error and the router, then the shards, stop.",
    )
    add(
        "--config",
        help="Read flags from this YAML file, each key a flag's name (either spelling, with or "
        "without dashes), each value its value. Flags on the command line override it.",
    )

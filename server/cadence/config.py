"""Typed configuration, built once from the CLI and passed down.

The field defaults here are the Python side's only copy of its flags' defaults: the CLI
reads them, and `LaunchConfig` takes its shard settings' defaults from `ShardConfig`. The
router's flags default to None here ("the router's own default"): the launcher forwards
only what was set, and the help shows the router's defaults (`cadence.router`).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
QUANTIZE_METHODS = ("int8", "int4")
SPECULATIVE_METHODS = ("ngram", "draft", "synthetic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # the router's --reasoning-parser names
GROUP_SIZES = (32, 64, 128)
KEEP_FLOAT_CHOICES = ("auto", "on", "off")


@dataclass(slots=True)
class ShardConfig:
    """What one shard process needs: which model, where to listen, how much memory."""

    model_dir: str  # a local Hugging Face folder (config.json, *.safetensors)
    uds_path: str  # unix socket the gRPC server listens on
    dtype: str = "auto"  # "float32" | "bfloat16" | "float16" | "auto" (isa.default_dtype)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    block_size: int = 16  # tokens per KV block
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    kv_cache_dtype: str | None = None  # a kv_format.KV_CACHE_DTYPES entry; None: follow dtype
    kv_cache_scales: str = ""  # fp8 cache: JSON file of per-layer scales; "": from warm-up
    log_format: str = "text"  # "text" | "json"
    model_id: str = ""  # reported by Info; "" = model_dir
    cpu_isa: str = "auto"  # the C++ kernels' instruction set: "auto" or one of isa.ISAS
    attention_backend: str = "auto"  # one of shard.backends.ATTENTION_BACKENDS
    cpu_kernels: bool = True  # the C++ CPU kernels serve what they cover (False: torch)
    huge_pages: bool = True  # on CPU, the KV cache and packed weights on 2 MB pages
    # a request's logits independent of its step's other rows, chunking, cache hits and
    # preemption (cadence.shard.determinism); honoured on CPU with the C++ kernels
    deterministic: bool = True
    cpu_threads: int = 0  # compute threads on CPU; 0: torch's default (every core it may use)
    cpu_cores: str = ""  # cores to pin the process to, comma-separated; "": no pinning
    quantize: str | None = None  # "int8" | "int4": quantize a float checkpoint's linears
    quantize_group_size: int = 32  # int4 group size (32, 64, 128); docs/quantization.md
    quantize_keep_float: str = "auto"  # "auto" | "on" | "off": float copy for large products
    # which kernel multiplies quantized weights, as measured (cadence.quant.calibrate);
    # "": the built-in defaults (cadence launch measures and passes one on CPU)
    kernel_table: str = ""
    # speculative decoding, benchmarks only: the share of the router's proposals accepted
    # regardless of the model (0: verify them against the model)
    speculative_acceptance: float = 0.0
    draft_model_id: str = ""  # speculative decoding's draft model folder; "": none
    draft_quantize: str | None = None  # "int8" | "int4": the draft's linears quantized at load


def default_of(cls: type, name: str) -> Any:
    """The default of the dataclass `cls`'s field `name`."""
    (field,) = (f for f in fields(cls) if f.name == name)
    assert field.default is not MISSING, f"{cls.__name__}.{name} has no default"
    return field.default


def _shard(name: str) -> Any:
    return default_of(ShardConfig, name)


def _router(default: bool | None = None) -> Any:
    """A router flag of the same name, forwarded when set: None (False for a switch) leaves
    the router's own default."""
    return field(default=default, metadata={"router": True})


def router_fields(cfg: LaunchConfig) -> list[str]:
    """The names of `cfg`'s fields that are router flags."""
    return [f.name for f in fields(cfg) if f.metadata.get("router")]


@dataclass(slots=True)
class LaunchConfig:
    """What `cadence launch` needs: its own settings, every shard's, and the router's."""

    # The launcher's.
    model_id: str | None = None  # None: the embedded SmolLM2, converted on first use
    num_shard: int = 1  # tensor-parallel ranks, one shard process each
    replicas: int = 1  # independent shard groups behind the one router
    master_port: int | None = None  # torch.distributed rendezvous; None: a free port
    kv_cache_memory: int | None = None  # bytes (the router's --kv-cache-bytes)
    async_scheduling: str = "auto"  # auto and on: on, off: off (docs/scheduler.md)
    uds_dir: str | None = None  # None: a fresh temp folder, removed at exit
    startup_timeout: float = 300.0  # seconds for each start step, the router's warm-up included
    # The router's too: the launcher waits for the router there, and for its drain on
    # SIGTERM (seconds). test_launch_config checks that they are the router's own defaults.
    hostname: str = "127.0.0.1"
    port: int = 8080
    shutdown_timeout: int = 30
    # Every shard's (and every process's log format).
    dtype: str = _shard("dtype")  # auto: resolve_cpu_choices picks by device and CPU
    kv_cache_dtype: str | None = _shard("kv_cache_dtype")  # None: isa.default_kv_cache_dtype
    kv_cache_scales: str = _shard("kv_cache_scales")
    device: str = _shard("device")
    cpu_isa: str = _shard("cpu_isa")
    block_size: int = _shard("block_size")
    attention_backend: str = _shard("attention_backend")
    cpu_kernels: bool = _shard("cpu_kernels")
    huge_pages: bool = _shard("huge_pages")
    deterministic: bool = _shard("deterministic")
    quantize: str | None = _shard("quantize")
    quantize_group_size: int = _shard("quantize_group_size")
    quantize_keep_float: str = _shard("quantize_keep_float")
    kernel_table: str = _shard("kernel_table")  # "": measured at first start on CPU
    draft_model_id: str = _shard("draft_model_id")  # launch resolves it like model_id
    draft_quantize: str | None = _shard("draft_quantize")
    speculative_acceptance: float = _shard("speculative_acceptance")
    log_format: str = _shard("log_format")
    # The router's, by the same names (the API key goes by environment instead).
    memory_fraction: float | None = _router()
    max_batch_tokens: int | None = _router()
    max_batch_size: int | None = _router()
    max_input_tokens: int | None = _router()
    max_total_tokens: int | None = _router()
    max_concurrent_requests: int | None = _router()
    max_stop_sequences: int | None = _router()
    max_top_n_tokens: int | None = _router()
    max_best_of: int | None = _router()
    payload_limit: int | None = _router()
    api_key: str | None = None  # comma-separated; reaches the router by environment
    api_key_file: str | None = _router()
    max_concurrent_requests_per_key: int | None = _router()
    max_tokens_per_minute_per_key: int | None = _router()
    cors_allow_origin: str | None = _router()  # comma-separated
    cors_allow_headers: str | None = _router()  # comma-separated
    cors_allow_methods: str | None = _router()  # comma-separated
    ssl_certfile: str | None = _router()  # PEM; with ssl_keyfile: HTTPS
    ssl_keyfile: str | None = _router()
    max_prefill_chunk: int | None = _router()
    preemption: str | None = _router()
    swap_blocks: int | None = _router()
    batching: str | None = _router()
    batch_timeout_ms: int | None = _router()
    scheduling_policy: str | None = _router()  # fcfs, fair or priority
    objective_priorities: str | None = _router()  # NAME=P,... (gateway objectives)
    max_waiting_requests: int | None = _router()
    grammar_compile_timeout_ms: int | None = _router()
    served_model_name: str | None = _router()  # None: the model id
    chat_template: str | None = _router()  # a Jinja file or text; None: the model's
    reasoning_parser: str | None = _router()  # one of REASONING_PARSERS; None: no split
    ready_stall_timeout_ms: int | None = _router()
    otlp_endpoint: str | None = _router()  # None: OTEL_EXPORTER_OTLP_ENDPOINT, else no traces
    otlp_service_name: str | None = _router()
    no_grammar_fast_forward: bool = _router(False)
    no_prefix_caching: bool = _router(False)
    check_rank_agreement: bool = _router(False)  # the router compares every rank's step answer
    # speculative decoding (docs/speculative.md): who proposes, how many, and up to which
    # step size the router adds proposals (0: the shard's measured or default threshold)
    speculative: str | None = _router()  # one of SPECULATIVE_METHODS; None: off
    num_speculative_tokens: int | None = _router()
    ngram_min: int | None = _router()
    ngram_max: int | None = _router()
    speculative_max_step_tokens: int | None = _router()
    # LoRA adapters (docs/api.md, "LoRA adapters"): loaded at start (comma-separated
    # name=path), found in a folder on first use, the shards' host cache and the batch's
    # bounds, runtime loading
    lora_adapters: str | None = _router()
    lora_dir: str | None = _router()
    max_cpu_adapters: int | None = _router()
    max_adapters_per_batch: int | None = _router()
    allow_runtime_lora: bool = _router(False)

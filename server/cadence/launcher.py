"""`cadence launch`: converts or resolves the model, starts the shards, warms them up,
starts the router, then supervises them all until a signal or a child's death.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from cadence.supervisor import ChildExited, Stopped, Supervisor

EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
MiB = 1024**2
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # both stop the stack cleanly, exit 0


class LaunchError(RuntimeError):
    """A configuration the launcher cannot run."""


@dataclass(slots=True)
class LaunchConfig:
    model_id: str | None = None  # None: the embedded SmolLM2, converted on first use
    hostname: str = "127.0.0.1"
    port: int = 8080
    dtype: str = "auto"  # auto: resolve_cpu_choices picks by device and CPU
    kv_cache_dtype: str | None = None  # None: isa.default_kv_cache_dtype
    device: str = "cpu"
    cpu_isa: str = "auto"  # the C++ CPU kernels' instruction set (kernels/cpu/isa.py)
    num_shard: int = 1  # tensor-parallel ranks, one shard process each
    master_port: int | None = None  # torch.distributed rendezvous; None: a free port
    check_rank_agreement: bool = False  # router compares every rank's Step answer
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: memory_fraction of free memory
    memory_fraction: float = 0.1
    max_batch_tokens: int = 1024
    max_batch_size: int = 64
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_concurrent_requests: int = 128
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_best_of: int = 8
    payload_limit: int = 2_000_000
    api_key: str | None = None  # comma-separated; reaches the router by environment
    api_key_file: str | None = None
    cors_allow_origin: str | None = None  # comma-separated
    max_prefill_chunk: int = 0  # 0: up to max_batch_tokens
    preemption: str = "recompute"
    swap_blocks: int | None = None  # None: the router's default (4 x num_blocks)
    no_prefix_caching: bool = False
    async_scheduling: str = "auto"  # auto: on with a GPU, off on CPU (docs/scheduler.md)
    batching: str = "continuous"
    batch_timeout_ms: int = 50
    max_waiting_requests: int = 128
    log_format: str = "text"
    uds_dir: str | None = None  # None: a fresh temp folder, removed at exit
    startup_timeout: float = 300.0


def shard_argv(cfg: LaunchConfig, model_dir: str, uds_path: str, rank: int) -> list[str]:
    return [
        *(sys.executable, "-m", "cadence", "serve"),
        *("--model-id", model_dir, "--uds-path", uds_path),
        *("--dtype", cfg.dtype, "--device", cfg.device, "--block-size", str(cfg.block_size)),
        *("--cpu-isa", cfg.cpu_isa),
        *("--rank", str(rank), "--world-size", str(cfg.num_shard)),
        *("--master-addr", "127.0.0.1", "--master-port", str(cfg.master_port or 29500)),
        *(("--kv-cache-dtype", cfg.kv_cache_dtype) if cfg.kv_cache_dtype else ()),
        *("--log-format", cfg.log_format),
    ]


def router_argv(
    cfg: LaunchConfig, model_dir: str, uds_paths: list[str], num_blocks: int
) -> list[str]:
    argv = [sys.executable, "-m", "cadence.router", "--hostname", cfg.hostname]
    argv += ["--port", str(cfg.port)]
    for path in uds_paths:
        argv += ["--shard-uds-path", path]
    argv += ["--tokenizer", model_dir, "--model-id", cfg.model_id or EMBEDDED_MODEL_NAME]
    argv += ["--num-blocks", str(num_blocks), "--block-size", str(cfg.block_size)]
    argv += ["--max-batch-tokens", str(cfg.max_batch_tokens)]
    argv += ["--max-batch-size", str(cfg.max_batch_size)]
    if cfg.max_input_tokens is not None:
        argv += ["--max-input-tokens", str(cfg.max_input_tokens)]
    if cfg.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(cfg.max_total_tokens)]
    argv += ["--max-concurrent-requests", str(cfg.max_concurrent_requests)]
    argv += ["--max-stop-sequences", str(cfg.max_stop_sequences)]
    argv += ["--max-top-n-tokens", str(cfg.max_top_n_tokens)]
    argv += ["--max-best-of", str(cfg.max_best_of), "--payload-limit", str(cfg.payload_limit)]
    if cfg.api_key_file:
        argv += ["--api-key-file", cfg.api_key_file]
    if cfg.cors_allow_origin:
        argv += ["--cors-allow-origin", cfg.cors_allow_origin]
    argv += _scheduler_argv(cfg)
    argv += ["--log-format", cfg.log_format]
    if cfg.check_rank_agreement:
        argv += ["--check-rank-agreement"]
    return argv


def router_env(cfg: LaunchConfig, env: dict[str, str]) -> dict[str, str]:
    """The router's environment: API keys go there, not on a command line `ps` shows."""
    env = dict(env)
    env.pop("CADENCE_API_KEY", None)
    if cfg.api_key:
        env["CADENCE_API_KEY"] = cfg.api_key
    return env


def _scheduler_argv(cfg: LaunchConfig) -> list[str]:
    argv = ["--max-prefill-chunk", str(cfg.max_prefill_chunk)]
    argv += ["--preemption", cfg.preemption, "--batching", cfg.batching]
    argv += ["--batch-timeout-ms", str(cfg.batch_timeout_ms)]
    argv += ["--max-waiting-requests", str(cfg.max_waiting_requests)]
    if cfg.swap_blocks is not None:
        argv += ["--swap-blocks", str(cfg.swap_blocks)]
    if cfg.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if not async_scheduling(cfg):
        argv.append("--no-async-scheduling")
    return argv


def async_scheduling(cfg: LaunchConfig) -> bool:
    """On a GPU the round trip between steps is idle host time worth hiding; on a CPU the
    forward already uses every core and the overlapped work only competes with it."""
    if cfg.async_scheduling == "auto":
        return cfg.device.startswith("cuda")
    return cfg.async_scheduling == "on"


C = TypeVar("C")  # LaunchConfig or ShardConfig: both have device, dtype, cpu_isa


def resolve_cpu_choices(cfg: C) -> C:
    """`cfg` with `cpu_isa`, `dtype` and `kv_cache_dtype` made concrete: the instruction
    set the CPU kernels run with (the best the CPU has, or the one asked for, checked here
    so a CPU lacking it is a clear error at start rather than a crash in a shard), the
    dtype that serves fastest with it, and the KV cache's dtype."""
    from cadence.kernels.cpu import isa

    try:
        chosen = isa.resolve(cfg.cpu_isa)
    except isa.IsaError as err:
        raise LaunchError(str(err)) from None
    dtype = isa.default_dtype(cfg.device, chosen) if cfg.dtype == "auto" else cfg.dtype
    kv_dtype = cfg.kv_cache_dtype or isa.default_kv_cache_dtype(cfg.device, dtype)
    return replace(cfg, cpu_isa=chosen, dtype=dtype, kv_cache_dtype=kv_dtype)


def launch(cfg: LaunchConfig) -> int:
    """Runs the whole stack; returns the process exit code."""
    from cadence.kernels.cpu import isa
    from cadence.model_source import resolve_model

    cfg = resolve_cpu_choices(cfg)
    logger.info(
        "CPU {!r} runs {}: kernels for {}, {} weights",
        isa.cpu_model(),
        ", ".join(isa.supported()),
        cfg.cpu_isa,
        cfg.dtype,
    )
    if cfg.num_shard > 1 and cfg.master_port is None:
        cfg = replace(cfg, master_port=_free_port())

    model_dir = resolve_model(cfg.model_id)
    own_dir = cfg.uds_dir is None
    uds_dir = Path(cfg.uds_dir or tempfile.mkdtemp(prefix="cadence-"))
    uds_dir.mkdir(parents=True, exist_ok=True)
    uds_paths = [str(uds_dir / f"shard-{rank}.sock") for rank in range(cfg.num_shard)]
    supervisor = Supervisor(prefix_lines=cfg.log_format == "text")
    previous = {sig: signal.signal(sig, supervisor.request_stop) for sig in _STOP_SIGNALS}
    try:
        _run(cfg, supervisor, model_dir, uds_paths)
        return 0
    except Stopped:
        logger.info("stop requested; shutting down")
        return 0
    except ChildExited as err:
        logger.error(err.report())
        return 1
    except (TimeoutError, LaunchError) as err:
        logger.error(str(err))
        return 1
    finally:
        supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_dir:
            shutil.rmtree(uds_dir, ignore_errors=True)
        else:
            for path in uds_paths:
                Path(path).unlink(missing_ok=True)


def shard_client(uds_path: str) -> Any:
    from cadence.shard.client import ShardClient

    return ShardClient(uds_path)


def _run(cfg: LaunchConfig, supervisor: Supervisor, model_dir: str, uds_paths: list[str]) -> None:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    for rank, path in enumerate(uds_paths):
        supervisor.start(f"shard-{rank}", shard_argv(cfg, model_dir, path, rank), env)
    clients = [shard_client(path) for path in uds_paths]
    for rank, client in enumerate(clients):
        supervisor.wait_until(
            lambda c=client, p=uds_paths[rank]: _answers_health(c, p),
            cfg.startup_timeout,
            f"shard-{rank} answering Health",
        )
    warmups = _warmup(cfg, supervisor, clients)
    num_blocks = min(w.num_blocks for w in warmups)
    _log_capacity(warmups, num_blocks)
    argv = router_argv(cfg, model_dir, uds_paths, num_blocks)
    supervisor.start("router", argv, router_env(cfg, env))
    url = f"http://{_connect_host(cfg.hostname)}:{cfg.port}"
    supervisor.wait_until(
        lambda: _http_ok(f"{url}/health"), cfg.startup_timeout, "the router answering /health"
    )
    logger.info("cadence ready on http://{}:{}", cfg.hostname, cfg.port)
    supervisor.watch()
    raise Stopped()


def _answers_health(client: Any, uds_path: str) -> bool:
    if not os.path.exists(uds_path):
        return False
    try:
        client.health(timeout=2.0)
        return True
    except Exception:  # grpc.RpcError while the server is still coming up
        return False


def _warmup(cfg: LaunchConfig, supervisor: Supervisor, clients: list[Any]) -> list[Any]:
    """Warmup on every shard at once (tensor-parallel ranks profile together)."""
    pool = ThreadPoolExecutor(len(clients), thread_name_prefix="warmup")
    try:
        futures = [
            pool.submit(
                c.warmup,
                max_batch_tokens=cfg.max_batch_tokens,
                max_batch_size=cfg.max_batch_size,
                kv_cache_bytes=cfg.kv_cache_memory or 0,
                memory_fraction=cfg.memory_fraction,
            )
            for c in clients
        ]
        supervisor.wait_until(
            lambda: all(f.done() for f in futures), cfg.startup_timeout, "shard warmup"
        )
        return [f.result() for f in futures]
    finally:
        # On a stop or a dead shard, do not wait for calls the stopping shards will end.
        pool.shutdown(wait=False, cancel_futures=True)


def _log_capacity(warmups: list[Any], num_blocks: int) -> None:
    """The KV capacity, then each rank's memory: weights, activations and KV bytes."""
    first = warmups[0]
    logger.info(
        "KV cache: {} blocks x {} tokens = {} tokens",
        num_blocks,
        first.block_size,
        num_blocks * first.block_size,
    )
    for rank, w in enumerate(warmups):
        logger.info(
            "rank {}: weights {:.1f} MiB; activations {:.1f} MiB; KV cache {:.1f} MiB "
            "({} KiB per block)",
            rank,
            w.weight_bytes / MiB,
            w.activation_bytes / MiB,
            w.kv_cache_bytes / MiB,
            w.bytes_per_block // 1024,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _connect_host(hostname: str) -> str:
    """Where to reach a server bound to `hostname` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(hostname, hostname)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False

"""`cadence launch`: converts or resolves the model, starts the shards, then the router,
which warms the shards up before it serves, then supervises them all until a signal or a
child's death. It speaks no gRPC: a shard is up once its socket exists, the stack once the
router answers /ready.

On SIGTERM or SIGINT the router is stopped first and alone: it drains (its requests in
flight finish, new ones get 503) for up to --shutdown-timeout seconds and exits; only
then are the shards stopped, and the launcher exits 0. When any child dies on its own,
the launcher stops the others and exits 1, so an orchestrator restarts the whole stack.
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
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from loguru import logger

from cadence.config import LaunchConfig, router_fields
from cadence.docs_assets import swagger_ui_dir
from cadence.supervisor import ChildExited, Stopped, Supervisor

EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # both stop the stack cleanly, exit 0
# Beyond --shutdown-timeout: the router's last writes after a drain, and its exit.
_ROUTER_EXIT_MARGIN = 10.0


class LaunchError(RuntimeError):
    """A configuration the launcher cannot run."""


def shard_argv(cfg: LaunchConfig, model_dir: str, uds_path: str, rank: int) -> list[str]:
    """Every shard setting, explicitly: a shard reads the environment twins too, and a flag
    given to the launcher must win over them there as well."""
    return [
        *(sys.executable, "-m", "cadence", "serve"),
        *("--model-id", model_dir, "--uds-path", uds_path),
        *("--dtype", cfg.dtype, "--device", cfg.device, "--block-size", str(cfg.block_size)),
        *("--cpu-isa", cfg.cpu_isa, "--attention-backend", cfg.attention_backend),
        "--cpu-kernels" if cfg.cpu_kernels else "--no-cpu-kernels",
        *("--rank", str(rank), "--world-size", str(cfg.num_shard)),
        *(("--master-port", str(cfg.master_port)) if cfg.master_port else ()),
        *(("--kv-cache-dtype", cfg.kv_cache_dtype) if cfg.kv_cache_dtype else ()),
        *("--log-format", cfg.log_format),
    ]


def router_argv(cfg: LaunchConfig, model_dir: str, uds_paths: list[str]) -> list[str]:
    """The router's command line: what it cannot know, and the router flags that were set
    (the others keep the router's own defaults)."""
    argv = [sys.executable, "-m", "cadence.router", "--hostname", cfg.hostname]
    argv += ["--port", str(cfg.port), "--shutdown-timeout", str(cfg.shutdown_timeout)]
    for path in uds_paths:
        argv += ["--shard-uds-path", path]
    argv += ["--tokenizer", model_dir, "--model-id", cfg.model_id or EMBEDDED_MODEL_NAME]
    argv += ["--log-format", cfg.log_format]
    if cfg.kv_cache_memory is not None:
        argv += ["--kv-cache-bytes", str(cfg.kv_cache_memory)]
    if not async_scheduling(cfg):
        argv.append("--no-async-scheduling")
    if (docs_assets := swagger_ui_dir()) is not None:
        argv += ["--docs-assets", str(docs_assets)]
    for name in router_fields(cfg):
        value, flag = getattr(cfg, name), "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def router_env(cfg: LaunchConfig, env: dict[str, str]) -> dict[str, str]:
    """The router's environment: API keys go there, not on a command line `ps` shows."""
    env = dict(env)
    env.pop("CADENCE_API_KEY", None)
    if cfg.api_key:
        env["CADENCE_API_KEY"] = cfg.api_key
    return env


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
        # The router first and alone: it drains while the shards still compute.
        supervisor.stop_child("router", cfg.shutdown_timeout + _ROUTER_EXIT_MARGIN)
        supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_dir:
            shutil.rmtree(uds_dir, ignore_errors=True)
        else:
            for path in uds_paths:
                Path(path).unlink(missing_ok=True)


def _run(cfg: LaunchConfig, supervisor: Supervisor, model_dir: str, uds_paths: list[str]) -> None:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    for rank, path in enumerate(uds_paths):
        Path(path).unlink(missing_ok=True)  # left by a killed run, it would pass for a shard
        supervisor.start(f"shard-{rank}", shard_argv(cfg, model_dir, path, rank), env)
    for rank, path in enumerate(uds_paths):
        supervisor.wait_until(
            lambda p=path: os.path.exists(p), cfg.startup_timeout, f"shard-{rank} listening"
        )
    supervisor.start("router", router_argv(cfg, model_dir, uds_paths), router_env(cfg, env))
    url = f"http://{_connect_host(cfg.hostname)}:{cfg.port}"
    supervisor.wait_until(
        lambda: _http_ok(f"{url}/ready"),
        cfg.startup_timeout,
        "the router warming the shards up and answering /ready",
    )
    logger.info("cadence ready on http://{}:{}", cfg.hostname, cfg.port)
    supervisor.watch()
    raise Stopped()


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

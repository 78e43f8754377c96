"""`cadence launch`: converts or resolves the model, starts the shards, then the router,
which warms the shards up before it serves, then supervises them all until a signal or a
child's death. It speaks no gRPC: a shard is up once its socket exists, the stack once the
router answers /ready.

With --replicas N it starts N independent shard groups (each --num-shard processes with
their own torch.distributed rendezvous, and on CPU their own cores) behind the one router.

On SIGTERM or SIGINT the router is stopped first and alone: it drains (its requests in
flight finish, new ones get 503) for up to --shutdown-timeout seconds and exits; only
then are the shards stopped, and the launcher exits 0. When the router or the last
replica dies on its own, the launcher stops the others and exits 1, so an orchestrator
restarts the whole stack. A shard of one replica among several that dies takes only its
replica down (its other ranks are stopped; the router stops sending it requests) and the
others keep serving.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from loguru import logger

from cadence.config import LaunchConfig, router_fields
from cadence.cpu_placement import Placement, available_cores, plan
from cadence.docs_assets import swagger_ui_dir
from cadence.supervisor import ChildExited, Stopped, Supervisor

if TYPE_CHECKING:
    from cadence.quant.calibrate import KernelTable

EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # both stop the stack cleanly, exit 0
# Beyond --shutdown-timeout: the router's last writes after a drain, and its exit.
_ROUTER_EXIT_MARGIN = 10.0


class LaunchError(RuntimeError):
    """A configuration the launcher cannot run."""


@dataclass(frozen=True)
class ShardSlot:
    """One shard process of one replica: its name, socket, rank and rendezvous."""

    replica: int
    rank: int
    uds_path: str
    master_port: int | None
    placement: Placement | None  # None: torch's own threads, no pinning

    @property
    def name(self) -> str:
        return f"replica-{self.replica}-shard-{self.rank}"


def shard_slots(cfg: LaunchConfig, uds_dir: Path) -> list[ShardSlot]:
    """Every shard process, replica by replica, rank 0 first. With one replica the
    sockets keep their plain names; with several on a CPU each shard gets its cores."""
    total = cfg.replicas * cfg.num_shard
    placements: list[Placement | None] = [None] * total
    if cfg.replicas > 1 and cfg.device == "cpu":
        placements = list(plan(total, available_cores()))
    slots = []
    for replica in range(cfg.replicas):
        port = cfg.master_port if replica == 0 else None
        if cfg.num_shard > 1 and port is None:
            port = _free_port()
        for rank in range(cfg.num_shard):
            stem = f"shard-{rank}" if cfg.replicas == 1 else f"replica-{replica}-shard-{rank}"
            placement = placements[replica * cfg.num_shard + rank]
            slots.append(ShardSlot(replica, rank, str(uds_dir / f"{stem}.sock"), port, placement))
    return slots


def shard_argv(cfg: LaunchConfig, model_dir: str, slot: ShardSlot) -> list[str]:
    """Every shard setting, explicitly: a shard reads the environment twins too, and a flag
    given to the launcher must win over them there as well."""
    placed = slot.placement
    return [
        *(sys.executable, "-m", "cadence", "serve"),
        *("--model-id", model_dir, "--uds-path", slot.uds_path),
        *("--dtype", cfg.dtype, "--device", cfg.device, "--block-size", str(cfg.block_size)),
        *("--cpu-isa", cfg.cpu_isa, "--attention-backend", cfg.attention_backend),
        "--cpu-kernels" if cfg.cpu_kernels else "--no-cpu-kernels",
        "--huge-pages" if cfg.huge_pages else "--no-huge-pages",
        "--deterministic" if cfg.deterministic else "--no-deterministic",
        *("--rank", str(slot.rank), "--world-size", str(cfg.num_shard)),
        *(("--master-port", str(slot.master_port)) if slot.master_port else ()),
        *(("--cpu-threads", str(placed.threads)) if placed else ()),
        *(("--cpu-cores", placed.cores_arg()) if placed else ()),
        *(("--kv-cache-dtype", cfg.kv_cache_dtype) if cfg.kv_cache_dtype else ()),
        *(("--quantize", cfg.quantize) if cfg.quantize else ()),
        *("--quantize-group-size", str(cfg.quantize_group_size)),
        *("--quantize-keep-float", cfg.quantize_keep_float),
        *(("--kernel-table", cfg.kernel_table) if cfg.kernel_table else ()),
        *(("--kv-cache-scales", cfg.kv_cache_scales) if cfg.kv_cache_scales else ()),
        *(("--draft-model-id", cfg.draft_model_id) if cfg.draft_model_id else ()),
        *(("--draft-quantize", cfg.draft_quantize) if cfg.draft_quantize else ()),
        *("--speculative-acceptance", str(cfg.speculative_acceptance)),
        *("--log-format", cfg.log_format),
    ]


def router_argv(cfg: LaunchConfig, model_dir: str, uds_paths: list[str]) -> list[str]:
    """The router's command line: what it cannot know, and the router flags that were set
    (the others keep the router's own defaults)."""
    argv = [sys.executable, "-m", "cadence.router", "--hostname", cfg.hostname]
    argv += ["--port", str(cfg.port), "--shutdown-timeout", str(cfg.shutdown_timeout)]
    argv += ["--shard-connect-timeout", str(math.ceil(cfg.startup_timeout))]
    for path in uds_paths:
        argv += ["--shard-uds-path", path]
    argv += ["--tokenizer", model_dir, "--model-id", cfg.model_id or EMBEDDED_MODEL_NAME]
    argv += ["--log-format", cfg.log_format]
    if cfg.replicas > 1:
        argv += ["--replicas", str(cfg.replicas)]
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
    """On by default on every device: beside a GPU the round trip between steps is idle
    host time; on a CPU the forward thread no longer waits for it, at no cost in throughput
    even on 2 cores (docs/scheduler.md has the measurement)."""
    return cfg.async_scheduling != "off"


def check_speculative(cfg: LaunchConfig) -> None:
    """The router's --speculative and the shards' draft flags must agree: a draft model
    nobody asks for would only take memory, and `draft` without one has nothing to run."""
    if cfg.speculative == "draft" and not cfg.draft_model_id:
        raise LaunchError("--speculative draft needs --draft-model-id (the draft model)")
    if cfg.draft_model_id and cfg.speculative != "draft":
        raise LaunchError(
            "--draft-model-id is only used with --speculative draft: add it or drop the draft"
        )
    if cfg.draft_quantize and not cfg.draft_model_id:
        raise LaunchError("--draft-quantize needs --draft-model-id and --speculative draft")
    if cfg.speculative_acceptance and cfg.speculative != "synthetic":
        raise LaunchError("--speculative-acceptance is only used with --speculative synthetic")


C = TypeVar("C")  # LaunchConfig or ShardConfig: both have device, dtype, cpu_isa


def resolve_cpu_choices(cfg: C) -> C:
    """`cfg` with `cpu_isa`, `dtype` and `kv_cache_dtype` made concrete: the instruction
    set the CPU kernels run with (the best the CPU has, or the one asked for, checked here
    so a CPU lacking it is a clear error at start rather than a crash in a shard), the
    dtype that serves fastest with it, and the KV cache's dtype (with its scales file, when
    one is given, checked here too)."""
    from cadence import cpu_isa as isa
    from cadence.kv_dtypes import check_kv_cache_choice

    try:
        chosen = isa.resolve(cfg.cpu_isa)
    except isa.IsaError as err:
        raise LaunchError(str(err)) from None
    dtype = isa.default_dtype(cfg.device, chosen) if cfg.dtype == "auto" else cfg.dtype
    kv_dtype = cfg.kv_cache_dtype or isa.default_kv_cache_dtype(cfg.device, dtype)
    try:
        check_kv_cache_choice(kv_dtype, cfg.kv_cache_scales)
    except ValueError as err:
        raise LaunchError(str(err)) from None
    return replace(cfg, cpu_isa=chosen, dtype=dtype, kv_cache_dtype=kv_dtype)


def serves_quantized(cfg: LaunchConfig, model_dir: str) -> bool:
    """Whether the shards will hold quantized weights: --quantize, a GGUF folder, or a
    checkpoint with a quantization config (GPTQ, AWQ)."""
    import json

    if cfg.quantize or (Path(model_dir) / "weights.gguf").exists():
        return True
    config = Path(model_dir) / "config.json"
    return config.exists() and "quantization_config" in json.loads(config.read_text())


def with_kernel_table(
    cfg: LaunchConfig, model_dir: str, quantized: bool | None = None
) -> LaunchConfig:
    """`cfg` with the kernel table its CPU shards read: measured here once per machine
    (`cadence calibrate`, in its own process: a few seconds) when none is cached for this
    CPU, dtype and torch; unchanged on a GPU, with a table given, or for weights it holds
    nothing for (neither quantized, float32, nor bfloat16 on the avx512_bf16 kernels, whose
    bfloat16 product may run on AMX tiles). A failed measurement leaves the built-in
    defaults, with a warning. `quantized`: `serves_quantized`'s answer, when the caller
    has it already."""
    from cadence.quant import calibrate, float_calibrate

    if cfg.kernel_table or cfg.device != "cpu" or not cfg.cpu_kernels:
        return cfg
    float32 = cfg.dtype == "float32" and cfg.cpu_isa in float_calibrate.TILE_ISAS
    bf16 = cfg.dtype == "bfloat16" and cfg.cpu_isa == "avx512_bf16"
    if quantized is None:
        quantized = serves_quantized(cfg, model_dir)
    if not (float32 or bf16 or quantized):
        return cfg
    path = calibrate.table_path()
    with calibrate.locked(path):
        cached = calibrate.read(path, calibrate.machine_key(cfg.cpu_isa, cfg.dtype))
        if needs_measuring(cached, float32, quantized, bf16):
            what = "quantized" if quantized else cfg.dtype
            logger.info(f"measuring which kernels serve {what} weights fastest here (once)")
            argv = [sys.executable, "-m", "cadence", "calibrate", "--cpu-isa", cfg.cpu_isa]
            argv += ["--dtype", cfg.dtype, "--log-format", cfg.log_format, "--keep-measured"]
            argv += [] if quantized else ["--float-only"]
            try:
                subprocess.run(argv, check=True, timeout=cfg.startup_timeout)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
                logger.warning(f"kernel calibration failed ({err}); serving with the defaults")
                return cfg
    return replace(cfg, kernel_table=str(path))


def needs_measuring(
    cached: KernelTable | None, float32: bool, quantized: bool, bf16: bool = False
) -> bool:
    """What the launch serves is not in the table for this machine: for quantized weights
    the formats and KV cache (a table from before the KV cache's measurement, or one
    holding only a float launch's, or one whose KV cache choice saw the decode step alone),
    for float32 weights the float32 product's, for bfloat16 ones on the avx512_bf16 kernels
    the bfloat16 product's."""
    from cadence.quant import calibrate

    if cached is None:
        return True
    if quantized and (not calibrate.kv_measured(cached) or not cached.formats):
        return True
    return (float32 and cached.float32 is None) or (bf16 and cached.bf16 is None)


def with_measured_kv_cache(
    cfg: LaunchConfig, kv_asked: bool, quantized: bool = True
) -> LaunchConfig:
    """`cfg` with the KV cache dtype the kernel table measured fastest for quantized
    serving on this machine (`cadence.quant.kv_calibrate`: int8 where its decode steps and
    prompts, mixed as the charter workload's, are clearly faster), unless one was asked for;
    unchanged without a table for this machine or for float weights (`quantized` False:
    they keep a float cache)."""
    from cadence.quant import calibrate, kv_calibrate

    if kv_asked or cfg.kv_cache_scales or not cfg.kernel_table or not quantized:
        return cfg
    key = calibrate.machine_key(cfg.cpu_isa, cfg.dtype)
    table = calibrate.read_for_machine(Path(cfg.kernel_table), key)
    if table is None or table.kv_cache is None or table.kv_cache.choice == cfg.kv_cache_dtype:
        return cfg
    logger.info("KV cache: {}", kv_calibrate.describe(table.kv_cache))
    return replace(cfg, kv_cache_dtype=table.kv_cache.choice)


def launch(cfg: LaunchConfig) -> int:
    """Runs the whole stack; returns the process exit code."""
    from cadence import cpu_isa as isa
    from cadence.model_source import resolve_model

    check_port_free(cfg.hostname, cfg.port)  # now, not after the model has loaded
    check_tls_files(cfg)
    check_speculative(cfg)
    kv_asked = cfg.kv_cache_dtype is not None
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
    quantized = serves_quantized(cfg, model_dir)
    cfg = with_measured_kv_cache(with_kernel_table(cfg, model_dir, quantized), kv_asked, quantized)
    if cfg.draft_model_id:  # once here, not by every shard (a GGUF's folder is made once)
        cfg = replace(cfg, draft_model_id=resolve_model(cfg.draft_model_id))
    own_dir = cfg.uds_dir is None
    uds_dir = Path(cfg.uds_dir or tempfile.mkdtemp(prefix="cadence-"))
    uds_dir.mkdir(parents=True, exist_ok=True)
    slots = shard_slots(cfg, uds_dir)
    uds_paths = [slot.uds_path for slot in slots]
    supervisor = Supervisor(
        prefix_lines=cfg.log_format == "text", json_lines=cfg.log_format == "json"
    )
    previous = {sig: signal.signal(sig, supervisor.request_stop) for sig in _STOP_SIGNALS}
    # SIGHUP to the launcher (PID 1 in a container) is for the router: it reloads the keys.
    previous[signal.SIGHUP] = signal.signal(
        signal.SIGHUP, lambda *_: supervisor.forward("router", signal.SIGHUP)
    )
    try:
        _run(cfg, supervisor, model_dir, slots)
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


def _run(cfg: LaunchConfig, supervisor: Supervisor, model_dir: str, slots: list[ShardSlot]) -> None:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    names = {}
    for slot in slots:
        Path(slot.uds_path).unlink(missing_ok=True)  # left by a killed run: a fake shard
        name = f"shard-{slot.rank}" if cfg.replicas == 1 else slot.name
        names[name] = slot
        shard_env = env
        if slot.placement:  # OpenMP reads it when its first team starts
            shard_env = env | {"OMP_NUM_THREADS": str(slot.placement.threads)}
        supervisor.start(name, shard_argv(cfg, model_dir, slot), shard_env)
    # The router starts beside the shards, not after them: it loads its tokenizer and
    # templates on a core the shards' imports leave idle, then waits for their sockets
    # (--shard-connect-timeout, the start-up timeout: one for loading, one for warm-up).
    uds_paths = [slot.uds_path for slot in slots]
    supervisor.start("router", router_argv(cfg, model_dir, uds_paths), router_env(cfg, env))
    scheme = "https" if cfg.ssl_certfile else "http"
    url = f"{scheme}://{_connect_host(cfg.hostname)}:{cfg.port}"
    try:
        supervisor.wait_until(
            lambda: _http_ok(f"{url}/ready"),
            2 * cfg.startup_timeout,
            "the shards loading, the router warming them up and answering /ready",
            interval=0.05,
        )
    except ChildExited as err:
        raise _starting_shard_that_ended(supervisor, names, cfg.startup_timeout) or err from None
    logger.info("cadence ready on {}://{}:{}", scheme, cfg.hostname, cfg.port)
    _watch(cfg, supervisor, names)
    raise Stopped()


def _starting_shard_that_ended(
    supervisor: Supervisor, shards: dict[str, ShardSlot], timeout: float
) -> ChildExited | None:
    """After the router ended during the start: the shard that ended too, if one still
    starting does (within `timeout`). A model folder the shard cannot serve often lacks
    the tokenizer the router reads first, and the shard's reason is the one to report."""
    deadline = time.monotonic() + timeout
    starting = {c.name: c for c in supervisor.children if c.name in shards}
    while starting and time.monotonic() < deadline and not supervisor.stopping.is_set():
        for name, child in list(starting.items()):
            if child.proc.poll() is not None:
                child.drain()
                return ChildExited(child)
            if os.path.exists(shards[name].uds_path):  # it loaded: the router's error stands
                del starting[name]
        time.sleep(0.05)
    return None


def _watch(cfg: LaunchConfig, supervisor: Supervisor, shards: dict[str, ShardSlot]) -> None:
    """Returns when a stop is requested; raises ChildExited when the router or the last
    live replica dies. A dead shard of one replica among several takes its replica down
    alone: its other ranks would wait forever in their collectives."""
    live = set(range(cfg.replicas))
    while True:
        try:
            supervisor.watch()
            return
        except ChildExited as err:
            slot = shards.get(err.child.name)
            if slot is None or live == {slot.replica}:
                raise
            live.discard(slot.replica)
            logger.error("{}; replica {} is down, {} left", err.report(), slot.replica, len(live))
            group = [n for n, s in shards.items() if s.replica == slot.replica]
            supervisor.retire(group, timeout=10.0)


def check_port_free(hostname: str, port: int) -> None:
    """Binds `hostname:port` as the router will (SO_REUSEADDR, as tokio does) and lets it
    go: a port taken by another server is an error before any model loads, not after."""
    try:
        infos = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise LaunchError(f"--hostname {hostname}: {err.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            raise LaunchError(
                f"--port {port}: cannot listen on {hostname}:{port} ({err.strerror}); stop "
                "what listens there or choose another --port"
            ) from None


def check_tls_files(cfg: LaunchConfig) -> None:
    """Loads --ssl-certfile and --ssl-keyfile as a pair, as the router will, so that a wrong
    file is an error before any model loads."""
    if not cfg.ssl_certfile and not cfg.ssl_keyfile:
        return
    if not (cfg.ssl_certfile and cfg.ssl_keyfile):
        raise LaunchError("--ssl-certfile and --ssl-keyfile go together: give both or neither")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            cfg.ssl_certfile, cfg.ssl_keyfile
        )
    except (OSError, ssl.SSLError) as err:
        raise LaunchError(
            f"--ssl-certfile {cfg.ssl_certfile} / --ssl-keyfile {cfg.ssl_keyfile}: cannot be "
            f"loaded as a PEM certificate chain and its private key ({err})"
        ) from None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _connect_host(hostname: str) -> str:
    """Where to reach a server bound to `hostname` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(hostname, hostname)


# The readiness probe reaches its own child on this machine: the certificate may name the
# public host, not 127.0.0.1, and may be self-signed, so it is not verified here.
_PROBE_TLS = ssl.create_default_context()
_PROBE_TLS.check_hostname = False
_PROBE_TLS.verify_mode = ssl.CERT_NONE


def _http_ok(url: str) -> bool:
    context = _PROBE_TLS if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=2.0, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False

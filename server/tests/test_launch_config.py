"""What the launcher passes the router and the shards: the router flags that were set and
nothing else, every shard setting explicitly."""

from __future__ import annotations

from pathlib import Path

import pytest
from cadence.cli import build_parser, config_from
from cadence.config import LaunchConfig, ShardConfig, router_fields
from cadence.docs_assets import SWAGGER_UI_FILES, swagger_ui_dir
from cadence.launcher import router_argv, shard_argv, shard_slots


def _router_argv(cfg: LaunchConfig) -> list[str]:
    return router_argv(cfg, "/m", ["/u/shard-0.sock"])


@pytest.mark.parametrize(
    ("device", "choice", "overlapped"),
    [
        ("cpu", "auto", True),  # measured faster on 2 cores too (docs/scheduler.md)
        ("cuda", "auto", True),
        ("cuda:1", "auto", True),
        ("cpu", "on", True),
        ("cpu", "off", False),
        ("cuda", "off", False),
    ],
)
def test_async_scheduling_is_on_unless_asked_off(device, choice, overlapped):
    argv = _router_argv(LaunchConfig(model_id="m", device=device, async_scheduling=choice))
    assert ("--no-async-scheduling" not in argv) == overlapped


def test_router_flags_left_unset_keep_the_routers_defaults() -> None:
    argv = _router_argv(LaunchConfig())
    flags = [a for a in argv[3:] if a.startswith("--")]
    assert flags == [
        *("--hostname", "--port", "--shutdown-timeout", "--shard-connect-timeout"),
        *("--shard-uds-path", "--tokenizer"),
        *("--model-id", "--log-format", "--docs-assets"),
    ]


def test_the_router_serves_swagger_ui_from_the_installed_package() -> None:
    argv = _router_argv(LaunchConfig())
    folder = Path(argv[argv.index("--docs-assets") + 1])
    assert folder == swagger_ui_dir() and folder.name.startswith("swagger-ui-5.")
    for name in SWAGGER_UI_FILES:
        assert (folder / name).stat().st_size > 0, name


def test_router_flags_that_were_set_are_forwarded_by_name() -> None:
    cfg = LaunchConfig(
        max_batch_tokens=256,
        memory_fraction=0.5,
        kv_cache_memory=1 << 20,
        preemption="swap",
        no_prefix_caching=True,
    )
    argv = _router_argv(cfg)
    assert argv[argv.index("--max-batch-tokens") + 1] == "256"
    assert argv[argv.index("--memory-fraction") + 1] == "0.5"
    assert argv[argv.index("--kv-cache-bytes") + 1] == str(1 << 20)
    assert argv[argv.index("--preemption") + 1] == "swap"
    assert "--no-prefix-caching" in argv and "--max-batch-size" not in argv


def test_every_router_flag_the_launcher_can_pass_is_one_the_router_parses(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Drift between the launcher's router fields and the router's own flags: the whole
    command line, every forwarded flag set, goes through the router's parser."""
    router = pytest.importorskip("cadence._router")
    values = {"preemption": "swap", "batching": "dynamic", "memory_fraction": 0.5}
    values |= {"speculative": "ngram", "reasoning_parser": "qwen3"}
    values |= {"api_key_file": "/k", "cors_allow_origin": "*"}
    values |= {"lora_adapters": "sql=/a/sql,chat=/a/chat", "lora_dir": "/loras"}
    values |= {"allow_runtime_lora": True}
    values |= {"scheduling_policy": "fair"}
    cfg = LaunchConfig(
        kv_cache_memory=1 << 20,
        **{
            name: values.get(name, True if name.startswith(("no_", "check_")) else 3)
            for name in router_fields(LaunchConfig())
        },
    )
    argv = _router_argv(cfg)
    assert all(("--" + name.replace("_", "-")) in argv for name in router_fields(cfg))
    router.serve(["cadence-router", *argv[3:], "--help"])  # an unknown flag raises
    assert "Usage: cadence-router" in capfd.readouterr().out


def test_the_launchers_router_address_defaults_are_the_routers() -> None:
    """The launcher must know where the router listens and how long it drains, so it
    keeps these three."""
    from cadence.router import flag_defaults

    defaults = flag_defaults()
    if not defaults:
        pytest.skip("the router is not built")
    cfg = LaunchConfig()
    assert (cfg.hostname, str(cfg.port)) == (defaults["--hostname"], defaults["--port"])
    assert str(cfg.shutdown_timeout) == defaults["--shutdown-timeout"]


def test_the_deploy_flags_reach_the_router() -> None:
    args = build_parser().parse_args(
        ["launch", "--served-model-name", "chat", "--ready-stall-timeout-ms", "2000"]
        + ["--shutdown-timeout", "5"]
    )
    argv = _router_argv(config_from(args, LaunchConfig))
    assert argv[argv.index("--served-model-name") + 1] == "chat"
    assert argv[argv.index("--ready-stall-timeout-ms") + 1] == "2000"
    assert argv[argv.index("--shutdown-timeout") + 1] == "5"


def test_shard_settings_reach_every_shards_config() -> None:
    cfg = LaunchConfig(attention_backend="torch", cpu_kernels=False, block_size=32)
    (slot,) = shard_slots(cfg, Path("/u"))
    args = build_parser().parse_args(shard_argv(cfg, "/m", slot)[3:])
    shard = config_from(args, ShardConfig, model_dir=args.model_id)
    assert (shard.attention_backend, shard.cpu_kernels, shard.block_size) == ("torch", False, 32)
    args = build_parser().parse_args(shard_argv(LaunchConfig(), "/m", slot)[3:])
    assert (args.attention_backend, args.cpu_kernels) == ("auto", True)


def test_the_trace_flags_reach_the_router() -> None:
    args = build_parser().parse_args(
        ["launch", "--otlp-endpoint", "http://collector:4318", "--otlp-service-name", "llm"]
    )
    argv = _router_argv(config_from(args, LaunchConfig))
    assert argv[argv.index("--otlp-endpoint") + 1] == "http://collector:4318"
    assert argv[argv.index("--otlp-service-name") + 1] == "llm"


def test_the_lora_flags_reach_the_router() -> None:
    args = build_parser().parse_args(
        ["launch", "--lora-adapters", "sql=/a/sql,chat=/a/chat", "--lora-dir", "/loras"]
        + ["--max-cpu-adapters", "8", "--max-adapters-per-batch", "2", "--allow-runtime-lora"]
    )
    argv = _router_argv(config_from(args, LaunchConfig))
    assert argv[argv.index("--lora-adapters") + 1] == "sql=/a/sql,chat=/a/chat"
    assert argv[argv.index("--lora-dir") + 1] == "/loras"
    assert argv[argv.index("--max-cpu-adapters") + 1] == "8"
    assert argv[argv.index("--max-adapters-per-batch") + 1] == "2"
    assert "--allow-runtime-lora" in argv
    plain = _router_argv(LaunchConfig())
    assert not any("lora" in a or "adapters" in a for a in plain)


def test_a_taken_port_stops_the_launch_before_any_shard_starts(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CADENCE_")}
        done = subprocess.run(
            [sys.executable, "-m", "cadence", "launch", "--port", str(port)],
            capture_output=True,
            text=True,
            env=env | {"CADENCE_CACHE_DIR": str(tmp_path)},
            timeout=120,
        )
    log = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"--port {port}" in log and "already in use" in log.lower()
    assert "starting shard-0" not in log  # no shard was started, no model loaded
    assert not any(tmp_path.iterdir())  # nor the embedded model converted


def test_the_chat_template_flag_reaches_the_router() -> None:
    args = build_parser().parse_args(["launch", "--chat-template", "/t/chat.jinja"])
    argv = _router_argv(config_from(args, LaunchConfig))
    assert argv[argv.index("--chat-template") + 1] == "/t/chat.jinja"
    assert "--chat-template" not in _router_argv(LaunchConfig())


def test_the_reasoning_parser_flag_reaches_the_router() -> None:
    args = build_parser().parse_args(["launch", "--reasoning-parser", "qwen3"])
    argv = _router_argv(config_from(args, LaunchConfig))
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert "--reasoning-parser" not in _router_argv(LaunchConfig())

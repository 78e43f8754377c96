"""Flag parsing: defaults, CADENCE_* environment twins, sizes, typed configs."""

from __future__ import annotations

import argparse
from itertools import combinations
from pathlib import Path

import pytest
from cadence.cli import ConvertConfig, build_parser, config_from
from cadence.config import ShardConfig
from cadence.cpu_placement import Placement, available_cores, parse_cores, plan
from cadence.flags import env_name, parse_size
from cadence.launcher import LaunchConfig, router_argv, shard_argv, shard_slots


@pytest.fixture(autouse=True)
def _no_cadence_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CADENCE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("512MiB", 512 * 1024**2),
        ("2GiB", 2 * 1024**3),
        ("1.5 GiB", int(1.5 * 1024**3)),
        ("1GB", 10**9),
        ("64kib", 64 * 1024),
    ],
)
def test_parse_size_accepts_bytes_and_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-1GiB"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_env_name_is_cadence_prefixed_upper_snake() -> None:
    assert env_name("--max-batch-tokens") == "CADENCE_MAX_BATCH_TOKENS"


def test_launch_defaults_build_the_documented_config() -> None:
    cfg = config_from(build_parser().parse_args(["launch"]), LaunchConfig)
    assert cfg == LaunchConfig()
    assert (cfg.hostname, cfg.port, cfg.dtype, cfg.device) == ("127.0.0.1", 8080, "auto", "cpu")
    assert (cfg.cpu_isa, cfg.attention_backend, cfg.cpu_kernels) == ("auto", "auto", True)
    # unset: each shard takes its device's default (0.9 of a GPU, 0.1 of MemAvailable)
    assert (cfg.kv_cache_memory, cfg.memory_fraction) == (None, None)


def test_launch_help_shows_the_routers_defaults_for_its_flags() -> None:
    pytest.importorskip("cadence._router")
    launch = build_parser()._subparsers._group_actions[0].choices["launch"]  # noqa: SLF001
    helps = {a.dest: a.help for a in launch._actions}  # noqa: SLF001
    # the shard's device decides --memory-fraction's default: the help names both
    assert "[env: CADENCE_MEMORY_FRACTION]" in helps["memory_fraction"]
    assert "default 0.9" in helps["memory_fraction"] and "default 0.1" in helps["memory_fraction"]
    assert "[default: 1024; env: CADENCE_MAX_BATCH_TOKENS]" in helps["max_batch_tokens"]
    assert "[default: recompute; env: CADENCE_PREEMPTION]" in helps["preemption"]


def test_launch_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["launch", "--port", "9000", "--kv-cache-memory", "512MiB", "--max-input-tokens", "100"]
    )
    cfg = config_from(args, LaunchConfig)
    assert (cfg.port, cfg.kv_cache_memory, cfg.max_input_tokens) == (9000, 512 * 1024**2, 100)


def test_environment_twins_set_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_PORT", "9100")
    monkeypatch.setenv("CADENCE_KV_CACHE_MEMORY", "1GiB")
    monkeypatch.setenv("CADENCE_LOG_FORMAT", "json")
    cfg = config_from(build_parser().parse_args(["launch"]), LaunchConfig)
    assert (cfg.port, cfg.kv_cache_memory, cfg.log_format) == (9100, 1024**3, "json")
    cfg = config_from(build_parser().parse_args(["launch", "--port", "1234"]), LaunchConfig)
    assert cfg.port == 1234


def test_bad_environment_values_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_DTYPE", "float64")
    with pytest.raises(SystemExit):
        build_parser()
    monkeypatch.setenv("CADENCE_DTYPE", "float16")
    monkeypatch.setenv("CADENCE_PORT", "eighty")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch"])


def test_every_flag_documents_its_environment_twin() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    for name, sub in commands.items():
        for action in sub._actions:  # noqa: SLF001
            if action.option_strings and action.dest != "help":
                assert "env: CADENCE_" in action.help, (name, action.dest)


def test_serve_requires_model_and_socket_unless_in_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    monkeypatch.setenv("CADENCE_MODEL_ID", "/models/m")
    monkeypatch.setenv("CADENCE_UDS_PATH", "/tmp/s.sock")
    args = build_parser().parse_args(["serve", "--rank", "1", "--world-size", "2"])
    cfg = config_from(args, ShardConfig, model_dir=args.model_id)
    assert cfg == ShardConfig(
        model_dir="/models/m", uds_path="/tmp/s.sock", rank=1, world_size=2, model_id="/models/m"
    )


def test_convert_has_its_own_dtype_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_DTYPE", "bfloat16")  # launch's, not convert's
    cfg = config_from(build_parser().parse_args(["convert"]), ConvertConfig)
    assert cfg == ConvertConfig(dtype="float32")
    monkeypatch.setenv("CADENCE_CONVERT_DTYPE", "float16")
    assert config_from(build_parser().parse_args(["convert"]), ConvertConfig).dtype == "float16"


def test_shard_and_router_command_lines_use_their_exact_flags() -> None:
    cfg = LaunchConfig(port=9000, max_total_tokens=2048)
    (slot,) = shard_slots(cfg, Path("/u"))
    shard = shard_argv(cfg, "/m", slot)
    assert shard[1:4] == ["-m", "cadence", "serve"]
    assert shard[shard.index("--uds-path") + 1] == "/u/shard-0.sock"
    router = router_argv(cfg, "/m", ["/u/shard-0.sock", "/u/shard-1.sock"])
    assert router[1:3] == ["-m", "cadence.router"]
    assert router.count("--shard-uds-path") == 2
    assert router[router.index("--tokenizer") + 1] == "/m"
    assert router[router.index("--max-total-tokens") + 1] == "2048"
    assert "--max-input-tokens" not in router


def test_tensor_parallel_flags_reach_every_shard_and_the_router() -> None:
    cfg = LaunchConfig(
        num_shard=2, master_port=29555, kv_cache_dtype="float32", check_rank_agreement=True
    )
    for rank, slot in enumerate(shard_slots(cfg, Path("/u"))):
        shard = shard_argv(cfg, "/m", slot)
        args = build_parser().parse_args(shard[3:])
        assert (args.rank, args.world_size, args.master_port) == (rank, 2, 29555)
        assert args.kv_cache_dtype == "float32"
    router = router_argv(cfg, "/m", ["/u/shard-0.sock", "/u/shard-1.sock"])
    assert "--check-rank-agreement" in router
    assert "--check-rank-agreement" not in router_argv(LaunchConfig(), "/m", ["/u/s"])


def test_replicas_get_their_own_sockets_rendezvous_and_cores() -> None:
    cfg = LaunchConfig(num_shard=2, replicas=2, master_port=29555)
    slots = shard_slots(cfg, Path("/u"))
    assert [(s.replica, s.rank) for s in slots] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({s.uds_path for s in slots}) == 4
    assert slots[0].master_port == slots[1].master_port == 29555
    assert slots[2].master_port == slots[3].master_port != 29555
    cores = [set(s.placement.cores) for s in slots if s.placement]
    if len(available_cores()) >= 4:  # disjoint sets, one per shard
        assert len(cores) == 4 and all(a.isdisjoint(b) for a, b in combinations(cores, 2))
    for slot in slots:
        args = build_parser().parse_args(shard_argv(cfg, "/m", slot)[3:])
        assert args.cpu_threads == slot.placement.threads
        assert parse_cores(args.cpu_cores) == list(slot.placement.cores)
    router = router_argv(cfg, "/m", [s.uds_path for s in slots])
    assert router[router.index("--replicas") + 1] == "2"
    assert router.count("--shard-uds-path") == 4
    alone = LaunchConfig()
    (slot,) = shard_slots(alone, Path("/u"))
    assert slot.placement is None and "--cpu-cores" not in shard_argv(alone, "/m", slot)
    assert "--replicas" not in router_argv(alone, "/m", [slot.uds_path])


def test_cores_are_split_evenly_and_shared_only_when_too_few() -> None:
    assert plan(2, [0, 1, 2, 3, 4]) == [Placement((0, 1), 2), Placement((2, 3), 2)]
    assert plan(3, [0, 1]) == [Placement((0, 1), 1)] * 3


def test_check_rank_agreement_has_an_environment_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not build_parser().parse_args(["launch"]).check_rank_agreement
    monkeypatch.setenv("CADENCE_CHECK_RANK_AGREEMENT", "true")
    assert config_from(build_parser().parse_args(["launch"]), LaunchConfig).check_rank_agreement


def test_shard_kernel_choices_have_environment_twins_and_flags_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve = ["serve", "--model-id", "/m", "--uds-path", "/s"]
    cfg = config_from(build_parser().parse_args(serve), ShardConfig, model_dir="/m")
    assert (cfg.attention_backend, cfg.cpu_kernels) == ("auto", True)
    monkeypatch.setenv("CADENCE_ATTENTION_BACKEND", "TORCH")
    monkeypatch.setenv("CADENCE_CPU_KERNELS", "0")
    cfg = config_from(build_parser().parse_args(serve), ShardConfig, model_dir="/m")
    assert (cfg.attention_backend, cfg.cpu_kernels) == ("torch", False)
    args = build_parser().parse_args([*serve, "--attention-backend", "cpu", "--cpu-kernels"])
    assert (args.attention_backend, args.cpu_kernels) == ("cpu", True)
    monkeypatch.delenv("CADENCE_CPU_KERNELS")
    cfg = config_from(build_parser().parse_args(["launch", "--no-cpu-kernels"]), LaunchConfig)
    assert cfg.cpu_kernels is False


def test_huge_pages_is_on_unless_turned_off_and_reaches_the_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve = ["serve", "--model-id", "/m", "--uds-path", "/s"]
    assert config_from(build_parser().parse_args(serve), ShardConfig, model_dir="/m").huge_pages
    monkeypatch.setenv("CADENCE_HUGE_PAGES", "0")
    cfg = config_from(build_parser().parse_args(serve), ShardConfig, model_dir="/m")
    assert cfg.huge_pages is False
    monkeypatch.delenv("CADENCE_HUGE_PAGES")
    launch = config_from(build_parser().parse_args(["launch", "--no-huge-pages"]), LaunchConfig)
    slot = shard_slots(launch, Path("/tmp"))[0]
    args = build_parser().parse_args(shard_argv(launch, "/m", slot)[3:])
    assert args.huge_pages is False


@pytest.mark.parametrize(
    ("name", "value"), [("CADENCE_ATTENTION_BACKEND", "flash"), ("CADENCE_CPU_KERNELS", "maybe")]
)
def test_bad_kernel_choices_in_the_environment_are_reported(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        build_parser()

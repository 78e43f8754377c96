"""`cadence launch`'s flags as vLLM users write them: vLLM's names as aliases, a YAML
--config file under the command line, --help grouped by concern in sentences."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from cadence.cli import build_parser, config_from, parse_args
from cadence.config import LaunchConfig


@pytest.fixture(autouse=True)
def _no_cadence_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CADENCE_"):
            monkeypatch.delenv(name)


def _launch(*argv: str) -> LaunchConfig:
    return config_from(parse_args(["launch", *argv]), LaunchConfig)


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["launch", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err


ALIASES = [
    (["--max-model-len", "4096"], ["--max-total-tokens", "4096"]),
    (["--tensor-parallel-size", "2"], ["--num-shard", "2"]),
    (["-tp", "2"], ["--num-shard", "2"]),
    (["--data-parallel-size", "3"], ["--replicas", "3"]),
    (["--max-num-seqs", "7"], ["--max-batch-size", "7"]),
    (["--max-num-batched-tokens", "2048"], ["--max-batch-tokens", "2048"]),
    (["--gpu-memory-utilization", "0.8"], ["--memory-fraction", "0.8"]),
    (["--kv-cache-memory-bytes", "1GiB"], ["--kv-cache-memory", "1GiB"]),
    (["--quantization", "int8"], ["--quantize", "int8"]),
    (["--host", "0.0.0.0"], ["--hostname", "0.0.0.0"]),
    (["--model", "/models/m"], ["--model-id", "/models/m"]),
    (["/models/m", "--port", "9000"], ["--model-id", "/models/m", "--port", "9000"]),
    (["--max-logprobs", "5"], ["--max-top-n-tokens", "5"]),
    (["--max-loras", "2"], ["--max-adapters-per-batch", "2"]),
    (["--max-cpu-loras", "9"], ["--max-cpu-adapters", "9"]),
    (["--no-enable-prefix-caching"], ["--no-prefix-caching"]),
    (["--lora-modules", "sql=/a", "chat=/b"], ["--lora-adapters", "sql=/a,chat=/b"]),
    (['--lora-modules={"name": "sql", "path": "/a"}'], ["--lora-adapters", "sql=/a"]),
    (["--dtype", "half"], ["--dtype", "float16"]),
    (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"]),
    (
        ['--speculative-config={"method": "ngram", "num_speculative_tokens": 3, '
         '"prompt_lookup_min": 2, "prompt_lookup_max": 4}'],
        ["--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "2",
         "--ngram-max", "4"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("vllm", "cadence"), ALIASES)
def test_vllm_names_set_the_same_settings_as_cadences(vllm: list[str], cadence: list[str]) -> None:
    assert _launch(*vllm) == _launch(*cadence) != LaunchConfig()


def test_the_draft_speculative_config_names_the_draft_model() -> None:
    cfg = _launch('--speculative-config={"model": "/draft", "num_speculative_tokens": 2}')
    assert (cfg.speculative, cfg.draft_model_id, cfg.num_speculative_tokens) == (
        "draft",
        "/draft",
        2,
    )


def test_enable_prefix_caching_is_the_default_turned_on_explicitly() -> None:
    assert _launch("--enable-prefix-caching") == LaunchConfig()
    assert _launch("--no-enable-prefix-caching").no_prefix_caching


def test_both_names_with_different_values_is_an_error_naming_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _error(capsys, "--max-model-len", "4096", "--max-total-tokens", "8192")
    assert "--max-model-len" in err and "--max-total-tokens" in err
    err = _error(capsys, "--no-prefix-caching", "--enable-prefix-caching")
    assert "--no-prefix-caching" in err and "--enable-prefix-caching" in err
    err = _error(capsys, "--speculative", "draft", '--speculative-config={"method": "ngram"}')
    assert "--speculative " in err and "--speculative-config" in err
    err = _error(capsys, "/models/a", "--model-id", "/models/b")
    assert "MODEL" in err and "--model-id" in err
    # the same value under both names is one setting
    assert _launch("--max-model-len", "4096", "--max-total-tokens", "4096").max_total_tokens == 4096


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--max-lora-rank", "16"], "adapter_config.json"),
        (["--swap-space", "4"], "--swap-blocks"),
        (["--seed", "0"], "per request"),
        (["--quantization", "awq"], "detected"),
        (["--speculative-config", '{"method": "eagle"}'], "eagle"),
        (["--speculative-config", '{"model": "/d", "quantization": "fp8"}'], "fp8"),
        (["--lora-modules", "sql"], "name=path"),
    ],
)
def test_vllm_flags_without_an_equivalent_are_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    assert reason in _error(capsys, *argv)


def test_help_shows_both_names_in_groups_by_concern() -> None:
    launch = _launch_parser()
    groups = {g.title: g for g in launch._action_groups}  # noqa: SLF001
    for title in ("model", "memory and batching", "scheduling", "API and auth"):
        assert title in groups
    for title in ("observability", "LoRA", "speculation", "deployment and processes"):
        assert title in groups
    ungrouped = [a.dest for a in groups["options"]._group_actions]  # noqa: SLF001
    assert ungrouped == ["help"]
    text = launch.format_help()
    assert "--max-total-tokens MAX_TOTAL_TOKENS, --max-model-len MAX_TOTAL_TOKENS" in text
    assert "--num-shard NUM_SHARD, --tensor-parallel-size NUM_SHARD, -tp NUM_SHARD" in text


@pytest.mark.parametrize("command", ["launch", "serve"])
def test_every_launch_and_serve_help_text_is_a_sentence(command: str) -> None:
    for action in _launch_parser(command)._actions:  # noqa: SLF001
        if action.dest == "help":
            continue
        text = action.help.removesuffix(" (default: %(default)s)").rsplit(" [", 1)[0]
        assert text.endswith("."), (action.dest, text)
        first = text.split()[0]
        assert not first[0].islower() or first.startswith("vLLM"), (action.dest, text)
        assert len(text.split()) >= 4, (action.dest, text)


def test_a_config_file_takes_flag_names_in_any_spelling(tmp_path: Path) -> None:
    config = tmp_path / "cadence.yaml"
    config.write_text(
        "max-model-len: 4096\n"
        "tensor_parallel_size: 2\n"
        "--port: 9000\n"
        "enable-prefix-caching: false\n"
        "cpu-kernels: false\n"
        "lora-modules: [sql=/a, chat=/b]\n"
        "api-key: [k1, k2]\n"
        "speculative-config: {method: ngram, num_speculative_tokens: 3}\n"
        "kv-cache-memory: 1GiB\n"
    )
    cfg = _launch("--config", str(config))
    assert (cfg.max_total_tokens, cfg.num_shard, cfg.port) == (4096, 2, 9000)
    assert cfg.no_prefix_caching and not cfg.cpu_kernels
    assert (cfg.lora_adapters, cfg.api_key) == ("sql=/a,chat=/b", "k1,k2")
    assert (cfg.speculative, cfg.num_speculative_tokens) == ("ngram", 3)
    assert cfg.kv_cache_memory == 1024**3


def test_the_command_line_overrides_the_file_which_overrides_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "cadence.yaml"
    config.write_text("max_model_len: 4096\nport: 9000\nmax-num-seqs: 8\n")
    monkeypatch.setenv("CADENCE_PORT", "9100")
    monkeypatch.setenv("CADENCE_MAX_BATCH_TOKENS", "512")
    cfg = _launch("--max-total-tokens", "8192", "--config", str(config), "--max-num-seqs", "4")
    assert (cfg.max_total_tokens, cfg.max_batch_size, cfg.port) == (8192, 4, 9000)
    assert cfg.max_batch_tokens == 512  # in neither: the environment twin


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("max-modle-len: 4096\n", "'max-modle-len'"),
        ("port: eighty\n", "--port"),
        ("no-prefix-caching: sometimes\n", "'no-prefix-caching'"),
        ("max-lora-rank: 16\n", "adapter_config.json"),
        ("- port\n", "mapping"),
        ("port: [\n", "not YAML"),
        ("max-model-len: 10\nmax-total-tokens: 20\n", "--max-model-len"),
    ],
)
def test_config_file_errors_name_the_key_and_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    err = _error(capsys, "--config", str(config))
    assert named in err
    if "'" in named:
        assert str(config) in err


def _launch_parser(command: str = "launch") -> argparse.ArgumentParser:
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices[command]  # noqa: SLF001

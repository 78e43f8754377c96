"""The speculative decoding flags: the shard ones reach every shard's config, the router
ones reach the router by name, and `launch` refuses a draft model without `--speculative
draft` and the other way round."""

from __future__ import annotations

from pathlib import Path

import pytest
from cadence.cli import build_parser, config_from, main
from cadence.config import LaunchConfig, ShardConfig
from cadence.launcher import LaunchError, check_speculative, router_argv, shard_argv, shard_slots
from cadence.logs import setup_logging


@pytest.fixture(autouse=True)
def _no_cadence_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CADENCE_"):
            monkeypatch.delenv(name)


def _launch(*flags: str) -> LaunchConfig:
    return config_from(build_parser().parse_args(["launch", *flags]), LaunchConfig)


def test_the_draft_flags_reach_every_shards_config() -> None:
    cfg = _launch(
        *("--speculative", "draft", "--draft-model-id", "/models/draft"),
        *("--draft-quantize", "int4", "--num-shard", "2"),
    )
    check_speculative(cfg)
    for slot in shard_slots(cfg, Path("/u")):
        args = build_parser().parse_args(shard_argv(cfg, "/m", slot)[3:])
        shard = config_from(args, ShardConfig, model_dir=args.model_id)
        assert (shard.draft_model_id, shard.draft_quantize) == ("/models/draft", "int4")
        assert shard.speculative_acceptance == 0.0


def test_a_shard_without_speculation_flags_runs_no_draft() -> None:
    (slot,) = shard_slots(LaunchConfig(), Path("/u"))
    argv = shard_argv(LaunchConfig(), "/m", slot)
    assert "--draft-model-id" not in argv and "--draft-quantize" not in argv
    args = build_parser().parse_args(argv[3:])
    shard = config_from(args, ShardConfig, model_dir=args.model_id)
    assert (shard.draft_model_id, shard.draft_quantize, shard.speculative_acceptance) == (
        "",
        None,
        0.0,
    )


def test_the_router_flags_reach_the_router_by_name_and_the_shard_ones_do_not() -> None:
    cfg = _launch(
        *("--speculative", "synthetic", "--speculative-acceptance", "0.75"),
        *("--num-speculative-tokens", "3", "--ngram-min", "2", "--ngram-max", "5"),
        *("--speculative-max-step-tokens", "64"),
    )
    check_speculative(cfg)
    argv = router_argv(cfg, "/m", ["/u/shard-0.sock"])
    expected = {
        "--speculative": "synthetic",
        "--num-speculative-tokens": "3",
        "--ngram-min": "2",
        "--ngram-max": "5",
        "--speculative-max-step-tokens": "64",
    }
    assert {flag: argv[argv.index(flag) + 1] for flag in expected} == expected
    assert "--speculative-acceptance" not in argv and "--draft-model-id" not in argv
    (slot,) = shard_slots(cfg, Path("/u"))
    shard = shard_argv(cfg, "/m", slot)
    assert shard[shard.index("--speculative-acceptance") + 1] == "0.75"
    assert "--speculative" not in shard


def test_speculation_stays_off_unless_asked() -> None:
    argv = router_argv(LaunchConfig(), "/m", ["/u/shard-0.sock"])
    assert not [a for a in argv if "speculative" in a or "ngram" in a]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--speculative", "draft"), ("--speculative draft", "--draft-model-id")),
        (("--draft-model-id", "/d"), ("--draft-model-id", "--speculative draft")),
        (("--speculative", "ngram", "--draft-model-id", "/d"), ("--draft-model-id",)),
        (("--draft-quantize", "int8"), ("--draft-quantize", "--draft-model-id")),
        (("--speculative-acceptance", "0.5"), ("--speculative synthetic",)),
    ],
)
def test_launch_refuses_draft_flags_that_do_not_go_together(
    flags: tuple[str, ...], named: tuple[str, ...]
) -> None:
    with pytest.raises(LaunchError) as err:
        check_speculative(_launch(*flags))
    for flag in named:
        assert flag in str(err.value)


def test_launch_stops_at_start_on_a_draft_without_speculative_draft(
    capfd: pytest.CaptureFixture[str],
) -> None:
    try:
        assert main(["launch", "--draft-model-id", "/nowhere"]) == 2
        assert "--speculative draft" in capfd.readouterr().err
    finally:
        setup_logging("text")  # main() pointed loguru at this test's captured stderr


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_an_acceptance_outside_zero_to_one_is_refused(value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model-id", "/m", "--uds-path", "/s",
                                   "--speculative-acceptance", value])  # fmt: skip

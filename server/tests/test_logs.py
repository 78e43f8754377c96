"""The Python side of the JSON log schema (the router writes the same, see
router/src/logging.rs), and the text format's request ids."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from cadence.logs import rfc3339_millis, setup_logging
from loguru import logger


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    setup_logging("text")


def json_lines(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines()]


def test_a_shard_line_about_a_request_has_the_schema_keys_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("json", "shard", rank=1)
    logger.bind(request_id="req-7").info("joined {} tokens", 12, tokens=12)
    (line,) = json_lines(capsys.readouterr().err)
    assert list(line) == [
        "timestamp",
        "level",
        "component",
        "rank",
        "request_id",
        "target",
        "message",
        "fields",
    ]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["timestamp"])
    assert (line["level"], line["component"], line["rank"]) == ("INFO", "shard", 1)
    assert (line["request_id"], line["message"]) == ("req-7", "joined 12 tokens")
    assert line["target"] == __name__
    assert line["fields"] == {"tokens": 12}


def test_a_launcher_line_has_no_rank_nor_request_id_and_levels_use_the_routers_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("json", "launcher")
    logger.warning("child {} ended", "shard-0", request_id="")
    logger.critical("gone")
    warning, critical = json_lines(capsys.readouterr().err)
    assert list(warning) == ["timestamp", "level", "component", "target", "message", "fields"]
    assert (warning["level"], warning["component"]) == ("WARN", "launcher")
    assert warning["message"] == "child shard-0 ended"
    assert critical["level"] == "ERROR"


def test_an_exception_goes_under_fields_on_the_same_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("json", "shard", rank=0)
    try:
        raise ValueError("bad step")
    except ValueError:
        logger.exception("step 3 failed")
    (line,) = json_lines(capsys.readouterr().err)
    assert line["level"] == "ERROR"
    assert "ValueError: bad step" in line["fields"]["exception"]


def test_text_lines_stay_readable_and_end_with_the_request_id(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("text")
    logger.bind(request_id="req-9").info("removed")
    logger.info("listening")
    about, other = capsys.readouterr().err.splitlines()
    assert about.endswith("- removed | request_id=req-9")
    assert other.endswith("- listening")


def test_timestamps_are_utc_with_milliseconds() -> None:
    paris = timezone(timedelta(hours=2))
    at = datetime(2024, 5, 1, 14, 30, 45, 123_999, tzinfo=paris)
    assert rfc3339_millis(at) == "2024-05-01T12:30:45.123Z"

"""Process-wide loguru setup: human-readable text, or one JSON object per line in the
schema the router writes too (docs/deploy.md, "Logs"):

`{"timestamp", "level", "component", ["rank"], ["request_id"], "target", "message",
"fields": {...}}`

A line about a request carries its id as `request_id`, given as a loguru extra
(`logger.debug("joined", request_id=...)`); every other extra goes under `fields`.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import datetime, timezone
from typing import Any

from loguru import logger

LOG_FORMATS = ("text", "json")
REQUEST_ID = "request_id"
# loguru's level names on the router's scale (Rust's `tracing` has no SUCCESS or CRITICAL).
_LEVELS = {"WARNING": "WARN", "SUCCESS": "INFO", "CRITICAL": "ERROR"}
_TEXT_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> | <level>{level: <8}</level> | "
    "<cyan>{name}</cyan>:<cyan>{function}</cyan>:<cyan>{line}</cyan> - <level>{message}</level>"
)


def setup_logging(
    log_format: str = "text", component: str = "launcher", rank: int | None = None
) -> None:
    """Sends logs to stderr; the level comes from LOGURU_LEVEL (default INFO). `component`
    and `rank` (a shard's) label every JSON line."""
    level = os.environ.get("LOGURU_LEVEL", "INFO")
    logger.remove()
    if log_format == "json":
        logger.add(JsonSink(component, rank), level=level, format="{message}", enqueue=False)
    else:
        logger.add(sys.stderr, level=level, format=_text_format, enqueue=False)


def _text_format(record: Any) -> str:
    """loguru's own layout, with the request id at the end of a line about a request."""
    suffix = " | request_id={extra[request_id]}" if record["extra"].get(REQUEST_ID) else ""
    return _TEXT_FORMAT + suffix + "\n{exception}"


class JsonSink:
    """Writes each record as one JSON line on stderr."""

    def __init__(self, component: str, rank: int | None) -> None:
        self.component = component
        self.rank = rank

    def __call__(self, message: Any) -> None:
        record = json_record(message.record, self.component, self.rank)
        # Compact, as the router writes it; extras JSON cannot hold are written as text.
        line = json.dumps(record, separators=(",", ":"), default=str)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def json_record(record: Any, component: str, rank: int | None) -> dict[str, Any]:
    """A loguru record as one line of the schema, its keys in the schema's order."""
    fields = dict(record["extra"])
    request_id = fields.pop(REQUEST_ID, None)
    if record["exception"] is not None:
        kind, value, tb = record["exception"]
        fields["exception"] = "".join(traceback.format_exception(kind, value, tb))
    line: dict[str, Any] = {
        "timestamp": rfc3339_millis(record["time"]),
        "level": _LEVELS.get(record["level"].name, record["level"].name),
        "component": component,
    }
    if rank is not None:
        line["rank"] = rank
    if request_id:
        line[REQUEST_ID] = str(request_id)
    line |= {"target": record["name"], "message": record["message"], "fields": fields}
    return line


def rfc3339_millis(time: datetime) -> str:
    """`time` in UTC with milliseconds: `2024-05-01T12:30:45.123Z`."""
    return time.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def wrap_foreign_line(line: str, child: str, stream: str) -> str:
    """A line a child process wrote outside its logger (a library's warning, a crash's
    traceback) as one line of the schema, so a JSON log stream stays JSON; a line that is
    already a JSON object passes unchanged. `child` is the launcher's name for the process
    (`router`, `shard-0`, `replica-1-shard-0`), `stream` is `stdout` or `stderr`."""
    stripped = line.strip()
    if stripped.startswith("{"):
        try:
            if isinstance(json.loads(stripped), dict):
                return line
        except ValueError:
            pass
    parts = child.split("-")
    component = "router" if child == "router" else "shard"
    record: dict[str, Any] = {
        "timestamp": rfc3339_millis(datetime.now(timezone.utc)),
        "level": "WARN" if stream == "stderr" else "INFO",
        "component": component,
    }
    if component == "shard" and parts[-1].isdigit():
        record["rank"] = int(parts[-1])
    record |= {"target": stream, "message": line, "fields": {"process": child}}
    return json.dumps(record, separators=(",", ":"))

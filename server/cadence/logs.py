"""Process-wide loguru setup: human-readable text or one JSON object per line."""

from __future__ import annotations

import os
import sys

from loguru import logger

LOG_FORMATS = ("text", "json")


def setup_logging(log_format: str = "text") -> None:
    """Sends logs to stderr; the level comes from LOGURU_LEVEL (default INFO)."""
    level = os.environ.get("LOGURU_LEVEL", "INFO")
    logger.remove()
    logger.add(sys.stderr, level=level, serialize=log_format == "json", enqueue=False)

"""Swagger UI's files for the router's /docs, found in the installed `swagger-ui-bundle-v2`
package, so the page loads nothing from another host. Swagger UI 5 or later: older ones
cannot read the OpenAPI 3.1 document the router generates."""

from __future__ import annotations

import re
from pathlib import Path

from loguru import logger

# What the router's /docs page loads (router/src/docs.rs serves exactly these).
SWAGGER_UI_FILES = ("swagger-ui-bundle.js", "swagger-ui.css")
_MIN_MAJOR = 5
_VERSIONED = re.compile(r"swagger-ui-(\d+)\.")


def swagger_ui_dir() -> Path | None:
    """The folder holding Swagger UI's script and stylesheet, or None (the package is
    missing, or holds a Swagger UI too old): the router then serves its built-in page."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    folder = Path(str(swagger_ui_path))
    version = _VERSIONED.match(folder.name)
    if version is None or int(version.group(1)) < _MIN_MAJOR:
        logger.warning(f"{folder.name} cannot show OpenAPI 3.1: /docs serves its own page")
        return None
    if not all((folder / name).is_file() for name in SWAGGER_UI_FILES):
        return None
    return folder

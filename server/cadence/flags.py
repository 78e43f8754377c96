"""argparse helpers: every flag gets a `CADENCE_<NAME>` environment twin, and size values."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from "512MiB", "2GiB", "1.5GB", "4096" (binary units are KiB/MiB/GiB/TiB)."""
    match = _SIZE_RE.match(text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a unit such as 512MiB, 2GiB, 1GB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def env_name(flag: str) -> str:
    """--max-batch-tokens -> CADENCE_MAX_BATCH_TOKENS."""
    return "CADENCE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    help: str,
    type: Callable[[str], Any] = str,
    default: Any = None,
    shown_default: Any = None,
    choices: Sequence[Any] | None = None,
    required: bool = False,
    env: str | None = None,
) -> None:
    """Adds `flag`, defaulting to its environment twin (`env`, or CADENCE_<FLAG>), then `default`.

    argparse runs `type` on string defaults, so an environment value is checked like a
    command-line one; `choices` are checked here because argparse skips them for defaults.
    `shown_default` is the default --help shows when `default` is None because another
    program (the router) applies it.
    """
    env = env or env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        if choices is not None and type(value) not in choices:
            parser.error(f"{env}={value!r} is not one of {list(choices)}")
        default, required = value, False
    shown = default if default is not None else shown_default
    shown = "" if shown is None else f"default: {shown}; "
    parser.add_argument(
        flag,
        type=type,
        default=default,
        choices=choices,
        required=required,
        help=f"{help} [{shown}env: {env}]",
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def add_switch(
    parser: argparse.ArgumentParser, flag: str, *, help: str, env: str | None = None
) -> None:
    """An on/off `flag`, on when given or when its twin (`env`, or CADENCE_<FLAG>) is
    1/true/yes/on."""
    env = env or env_name(flag)
    default = os.environ.get(env, "").strip().lower() in _TRUE
    parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env: {env}]")


def add_toggle(parser: argparse.ArgumentParser, flag: str, *, default: bool, help: str) -> None:
    """`flag` and `--no-<flag>`, defaulting to its twin CADENCE_<FLAG> (1/true/yes/on or
    0/false/no/off), then `default`."""
    env = env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        text = value.strip().lower()
        if text not in _TRUE + _FALSE:
            parser.error(f"{env}={value!r} is not one of {list(_TRUE + _FALSE)}")
        default = text in _TRUE
    shown = "on" if default else "off"
    parser.add_argument(
        flag,
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"{help} [default: {shown}; env: {env}]",
    )

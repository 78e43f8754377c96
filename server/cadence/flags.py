"""argparse helpers: every flag gets a `CADENCE_<NAME>` environment twin and may have other
names (vLLM's), and size values.

A flag given under two of its names with different values is an error naming both: the
actions here record which name set each setting (`given`), which also tells a config file's
values from the command line's.
"""

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


GIVEN = "_given"  # the namespace attribute: {dest: (the name that set it, its value)}
Container = argparse.ArgumentParser | argparse._ArgumentGroup  # noqa: SLF001


def given(namespace: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """The settings the parsed arguments set, each with the name that set it and its value."""
    return vars(namespace).setdefault(GIVEN, {})


def record(
    parser: argparse.ArgumentParser,
    namespace: argparse.Namespace,
    dest: str,
    name: str | None,
    value: Any,
) -> None:
    """Sets `dest` to `value`; an error when another name of the same setting set it to
    another value (the same name given twice: the last wins, as argparse does)."""
    name = name or dest
    earlier = given(namespace).get(dest)
    if earlier is not None and earlier[0] != name and earlier[1] != value:
        parser.error(
            f"{earlier[0]} {earlier[1]!r} and {name} {value!r} set the same setting to "
            "different values: give one of them"
        )
    given(namespace)[dest] = (name, value)
    setattr(namespace, dest, value)


class TrackedStore(argparse._StoreAction):  # noqa: SLF001
    """A valued flag that records the name that set it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        record(parser, namespace, self.dest, option_string, values)


class TrackedSwitch(argparse._StoreTrueAction):  # noqa: SLF001
    """An on switch that records the name that set it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        record(parser, namespace, self.dest, option_string, True)


class TrackedToggle(argparse.BooleanOptionalAction):
    """`--X` / `--no-X`, recording the name that set it; `inverted`: `--X` sets False (vLLM's
    --enable-prefix-caching is cadence's --no-prefix-caching turned over)."""

    def __init__(self, *args: Any, inverted: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inverted = inverted

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        on = not (option_string or "").startswith("--no-")
        record(parser, namespace, self.dest, option_string, on != self.inverted)


def env_name(flag: str) -> str:
    """--max-batch-tokens -> CADENCE_MAX_BATCH_TOKENS."""
    return "CADENCE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(
    parser: Container,
    flag: str,
    *aliases: str,
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
    program (the router) applies it. `aliases`: other names of the same flag (vLLM's).
    """
    env = env or env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        if choices is not None and type(value) not in choices:
            _bad_environment(f"{env}={value!r} is not one of {list(choices)}")
        default, required = value, False
    shown = default if default is not None else shown_default
    shown = "" if shown is None else f"default: {shown}; "
    parser.add_argument(
        flag,
        *aliases,
        action=TrackedStore,
        type=type,
        default=default,
        choices=choices,
        required=required,
        help=f"{help} [{shown}env: {env}]",
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def add_switch(
    parser: Container, flag: str, *aliases: str, help: str, env: str | None = None
) -> None:
    """An on/off `flag`, on when given or when its twin (`env`, or CADENCE_<FLAG>) is
    1/true/yes/on."""
    env = env or env_name(flag)
    default = os.environ.get(env, "").strip().lower() in _TRUE
    parser.add_argument(
        flag, *aliases, action=TrackedSwitch, default=default, help=f"{help} [env: {env}]"
    )


def add_toggle(parser: Container, flag: str, *, default: bool, help: str) -> None:
    """`flag` and `--no-<flag>`, defaulting to its twin CADENCE_<FLAG> (1/true/yes/on or
    0/false/no/off), then `default`."""
    env = env_name(flag)
    value = os.environ.get(env)
    if value is not None:
        text = value.strip().lower()
        if text not in _TRUE + _FALSE:
            _bad_environment(f"{env}={value!r} is not one of {list(_TRUE + _FALSE)}")
        default = text in _TRUE
    shown = "on" if default else "off"
    parser.add_argument(
        flag,
        action=TrackedToggle,
        default=default,
        help=f"{help} [default: {shown}; env: {env}]",
    )


def _bad_environment(message: str) -> None:
    """A bad environment twin, reported as argparse reports a bad flag (exit status 2)."""
    raise SystemExit(f"cadence: error: {message}")

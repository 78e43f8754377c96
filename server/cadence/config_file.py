"""`cadence launch --config FILE`: a YAML file of flags, under the command line's.

Each key is a flag's name in either spelling (cadence's or vLLM's), with or without its
dashes, with dashes or underscores; each value is what the flag takes (true or false for
a switch, a list for a comma-separated or repeated flag, a mapping for a JSON one). The
file becomes a command line parsed by the same parser, so its values are checked as the
flags' are; a setting given on the command line wins over the file's, and the file's
over the environment twins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from cadence.flags import given
from cadence.vllm_flags import REFUSED


class ConfigFileError(ValueError):
    """A config file cadence cannot read: the message names the file and the key."""


def with_config_file(
    parser: argparse.ArgumentParser, args: argparse.Namespace, path: Path
) -> argparse.Namespace:
    """`args` (a parsed `launch` command line) with the settings of the file at `path`
    that the command line left unset."""
    launch = _subparser(parser, "launch")
    file_args = parser.parse_args(["launch", *config_argv(launch, path)])
    from_command_line = given(args)
    for dest, (_name, value) in given(file_args).items():
        if dest not in from_command_line:
            setattr(args, dest, value)
    return args


def config_argv(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The file at `path` as the command line of `parser` it stands for."""
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigFileError(f"--config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigFileError(f"--config {path} is not YAML: {err}") from None
    if document is None:
        return []
    if not isinstance(document, dict):
        raise ConfigFileError(f"--config {path} must be a mapping of flag names to values")
    argv: list[str] = []
    for key, value in document.items():
        argv += _flag_argv(parser, path, str(key), value)
    return argv


def _flag_argv(parser: argparse.ArgumentParser, path: Path, key: str, value: Any) -> list[str]:
    name = key.lstrip("-").replace("_", "-")
    options = parser._option_string_actions  # noqa: SLF001
    flag = next((f for f in (f"--{name}", f"-{name}") if f in options), None)
    if f"--{name}" in REFUSED:
        raise ConfigFileError(f"{key!r} in {path}: {REFUSED[f'--{name}']}")
    if flag == "--config":
        raise ConfigFileError(f"{key!r} in {path}: a config file cannot name another")
    if flag is None or flag in ("-h", "--help"):
        raise ConfigFileError(f"unknown key {key!r} in {path}: it names no `cadence launch` flag")
    action = options[flag]
    if value is None:
        raise ConfigFileError(f"{key!r} in {path} has no value")
    if action.nargs == 0:  # a switch or an on/off pair
        if not isinstance(value, bool):
            raise ConfigFileError(f"{key!r} in {path} takes true or false, not {value!r}")
        if value:
            return [flag]
        opposite = _opposite(action, flag)
        return [opposite] if opposite else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        items = [json.dumps(v) if isinstance(v, dict) else str(v) for v in value]
        return [flag, *items] if action.nargs == "+" else [flag, ",".join(items)]
    if isinstance(value, bool):
        raise ConfigFileError(f"{key!r} in {path} takes a value, not {value!r}")
    return [flag, str(value)]


def _opposite(action: argparse.Action, flag: str) -> str | None:
    """The other name of an on/off pair (--x for --no-x and back); None for a switch, whose
    false is its default."""
    if not isinstance(action, argparse.BooleanOptionalAction):
        return None
    other = "--" + flag[len("--no-") :] if flag.startswith("--no-") else "--no-" + flag[2:]
    return other if other in action.option_strings else None


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return commands.choices[command]

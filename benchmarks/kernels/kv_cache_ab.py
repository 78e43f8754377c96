"""Two KV cache dtypes served side by side in one process, step by step: two shard engines
on the embedded SmolLM2 GGUF with the products a launch would take here (the kernel
table), one with each cache, fed the same requests, every step run on one engine and then
the other (A B, then B A). Prompts are prefilled three at a time, then the batch decodes.
The host's swings weigh on both sides alike, which alternated whole charter runs on a
shared 2-core guest (a fifth apart within minutes) cannot resolve. Prints the per-pair
ratios of B's step time to A's for the prompts' steps and the decode steps, and the two
mixed as the charter workload mixes them (4.5 decode steps a prompt).

    PYTHONPATH=server python benchmarks/kernels/kv_cache_ab.py bfloat16 int8
        [--batch 32] [--prompt 320] [--decode-steps 60] [--model-id FOLDER]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cadence import cpu_isa
from cadence.config import ShardConfig
from cadence.model_source import resolve_model
from cadence.pb import shard_pb2 as pb
from cadence.quant import calibrate
from cadence.quant.kv_calibrate import DECODE_WEIGHT, mix
from cadence.shard.engine import Engine


def engine_with(model_dir: str, kv_cache_dtype: str, dtype: str, kv_mib: int) -> Engine:
    cfg = ShardConfig(
        model_dir=model_dir,
        uds_path="/unused",
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kernel_table=str(calibrate.table_path()),
    )
    engine = Engine(cfg)
    engine.warmup(1024, 64, kv_mib * 1024**2, 0.1)
    return engine


def paired(engines: dict[str, Engine], step: pb.StepRequest, turn: int) -> dict[str, float]:
    """Seconds of `step` on each engine, A first on even turns and B first on odd ones."""
    seconds = {}
    for name in list(engines)[:: 1 if turn % 2 == 0 else -1]:
        started = time.perf_counter()
        engines[name].step(step)
        seconds[name] = time.perf_counter() - started
    return seconds


def summary(label: str, ratios: list[float]) -> float:
    ratios = sorted(ratios)
    q = len(ratios) // 4
    median = statistics.median(ratios)
    print(f"{label}: B / A median {median:.3f} (quartiles {ratios[q]:.3f}-{ratios[-q - 1]:.3f})")
    return median


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="side A's KV cache dtype (bfloat16, int8, ...)")
    p.add_argument("b", help="side B's")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=320)
    p.add_argument("--decode-steps", type=int, default=60)
    p.add_argument("--kv-mib", type=int, default=512)
    p.add_argument("--model-id", default=None, help="a model folder (default: the embedded GGUF)")
    a = p.parse_args(argv)
    if a.a == a.b:
        p.error("the two sides must differ")
    dtype = cpu_isa.default_dtype("cpu", cpu_isa.resolve("auto"))
    model_dir = resolve_model(a.model_id)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    engines = {
        side: engine_with(model_dir, kv, dtype, a.kv_mib) for side, kv in (("A", a.a), ("B", a.b))
    }
    per_request = (a.prompt + a.decode_steps + 2 + 15) // 16 + 1
    greedy = pb.SamplingParams(top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    joined = [
        pb.NewRequest(
            id=i,
            token_ids=[(7 * i + 13 * j) % vocab for j in range(a.prompt)],
            prompt_len=a.prompt,
            num_compute=a.prompt,
            block_table=list(range(i * per_request, (i + 1) * per_request)),
            sampling=greedy,
        )
        for i in range(a.batch)
    ]
    prompt_s = {"A": 0.0, "B": 0.0}
    prompt_ratios = []
    for turn, k in enumerate(range(0, a.batch, 3)):
        chunk = joined[k : k + 3]
        t = paired(engines, pb.StepRequest(joined=chunk), turn)
        for side in t:
            prompt_s[side] += t[side]
        prompt_ratios.append(t["B"] / t["A"])
    decode = pb.StepRequest(
        continuing=[pb.ContinuingRequest(id=i, num_compute=1) for i in range(a.batch)]
    )
    paired(engines, decode, 0)  # the decode workspaces, warmed
    decode_s = {"A": [], "B": []}
    for turn in range(a.decode_steps):
        t = paired(engines, decode, turn)
        for side in t:
            decode_s[side].append(t[side])
    decode_ratios = [b / x for x, b in zip(decode_s["A"], decode_s["B"], strict=True)]
    print(f"A: {a.a} cache, B: {a.b} cache; {dtype} activations, {cpu_isa.cpu_model()}")
    per_prompt = {side: s / a.batch for side, s in prompt_s.items()}
    print(f"a prompt of {a.prompt} tokens, mean: A {per_prompt['A'] * 1e3:.1f} ms, "
          f"B {per_prompt['B'] * 1e3:.1f} ms")  # fmt: skip
    print(f"a decode step of {a.batch} rows from {a.prompt} tokens, median: "
          f"A {statistics.median(decode_s['A']) * 1e3:.1f} ms, "
          f"B {statistics.median(decode_s['B']) * 1e3:.1f} ms")  # fmt: skip
    prompts = summary("prompts' steps", prompt_ratios)
    steps = summary("decode steps", decode_ratios)
    a_cost = mix(statistics.median(decode_s["A"]), per_prompt["A"])
    b_cost = mix(statistics.median(decode_s["B"]), per_prompt["B"])
    print(
        f"in the charter's mix ({DECODE_WEIGHT:g} decode steps a prompt): B / A "
        f"{b_cost / a_cost:.3f} (per-pair medians: prompts {prompts:.3f}, decode {steps:.3f})"
    )


if __name__ == "__main__":
    main()

"""Times and profiles the shard's whole `Engine.step` on the embedded SmolLM2 GGUF (no router,
no gRPC): 32 requests of 320 prompt tokens prefilled three at a time, then decode steps,
with a torch profiler table of one batch of decode steps.

    PYTHONPATH=server python benchmarks/kernels/engine_step_profile.py [--batch 32] [--prompt 320]
        [--kv-cache-dtype int8] [--profile-prefill] [--model-id FOLDER] [--dtype float32]
        [--float-product tiles|onednn] [--kernel-table FILE]

`--float-product onednn` packs float32 weights for oneDNN where the shard would take
cadence's float32 tiles (the `avx2` kernels): the two products of the same weights, for an
A/B in one sitting. `--kernel-table` serves the products a launch would on this machine
(`cadence calibrate` writes the table to `~/.cache/cadence/kernel_table.json`); without it
quantized weights take the integer product.
"""

from __future__ import annotations

import argparse
import time

from cadence.config import ShardConfig
from cadence.layers import packed
from cadence.model_source import resolve_model
from cadence.pb import shard_pb2 as pb
from cadence.shard.engine import Engine
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=320)
    p.add_argument(
        "--steps", type=int, default=10,
        help="decode steps: one to warm, three profiled, the rest (at least one) timed",
    )  # fmt: skip
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-mib", type=int, default=512)
    p.add_argument("--profile-prefill", action="store_true", help="profile a prefill step too")
    p.add_argument("--kv-cache-dtype", default=None, help="int8, bfloat16, ... (default: dtype)")
    p.add_argument("--model-id", default=None, help="a model folder (default: the embedded GGUF)")
    p.add_argument("--float-product", choices=("tiles", "onednn"), default="tiles")
    p.add_argument("--kernel-table", default="", help="a kernel table, as a launch passes")
    a = p.parse_args()
    if a.steps < 5:
        p.error("--steps must be at least 5 (one warm-up step, three profiled, one timed)")
    if a.float_product == "onednn":
        packed.float_tiles_serve = lambda: False  # read when the weights are packed
    cfg = ShardConfig(
        model_dir=resolve_model(a.model_id),
        uds_path="/unused",
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        kernel_table=a.kernel_table,
    )
    engine = Engine(cfg)
    engine.warmup(1024, 64, a.kv_mib * 1024**2, 0.1)
    per_request = (a.prompt + a.steps + 16) // 16 + 1  # blocks each request may fill
    greedy = pb.SamplingParams(top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    joined = [
        pb.NewRequest(
            id=i,
            token_ids=[(7 * i + j) % 40000 + 100 for j in range(a.prompt)],
            prompt_len=a.prompt,
            num_compute=a.prompt,
            block_table=list(range(i * per_request, (i + 1) * per_request)),
            sampling=greedy,
        )
        for i in range(a.batch)
    ]
    started = time.perf_counter()
    for k in range(0, a.batch, 3):
        engine.step(pb.StepRequest(joined=joined[k : k + 3]))
    print(f"prefill {a.batch} x {a.prompt}: {time.perf_counter() - started:.2f} s")
    if a.profile_prefill:  # one more prefill step of three prompts, into fresh blocks
        again = [
            pb.NewRequest(
                id=a.batch + i,
                token_ids=list(r.token_ids)[::-1],
                prompt_len=a.prompt,
                num_compute=a.prompt,
                block_table=[b + a.batch * per_request for b in r.block_table],
                sampling=greedy,
            )
            for i, r in enumerate(joined[:3])
        ]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step(pb.StepRequest(joined=again))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        engine.step(pb.StepRequest(removed=[r.id for r in again]))
    decode = pb.StepRequest(
        continuing=[pb.ContinuingRequest(id=i, num_compute=1) for i in range(a.batch)]
    )
    engine.step(decode)  # warm the workspace
    started = time.perf_counter()
    for _ in range(a.steps - 4):
        answer = engine.step(decode)
    per_step = (time.perf_counter() - started) / (a.steps - 4) * 1000
    forward_ms = answer.forward_ns / 1e6
    print(f"decode step, batch {a.batch}: {per_step:.1f} ms ({forward_ms:.1f} in forward)")
    print(f"float32 products: {engine.kernels['products']}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step(decode)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()

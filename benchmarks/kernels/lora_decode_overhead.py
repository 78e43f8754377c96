"""Times a decode step of the shard's `Engine.step` on the embedded SmolLM2's float copy
with and without LoRA adapters: 32 requests decoding together, first on the base model,
then each with its own rank-8 adapter on q_proj and v_proj (32 distinct adapters, paged
into the KV pool), then all 32 with one adapter. The LoRA products go through the C++ row
kernels where the engine's CPU kernels serve (`cadence.lora.cpu_rows`), or through torch
with --torch-lora.

    PYTHONPATH=server python benchmarks/kernels/lora_decode_overhead.py [--batch 32] [--rank 8] \
        [--threads 1] [--dtype float32] [--torch-lora]

Held to AVX2 (float32 is what such a CPU serves): ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 CADENCE_CPU_ISA=avx2.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from cadence import cpu_isa as cpu_isa
from cadence.config import ShardConfig
from cadence.kernels import cpu as cpu_kernels
from cadence.layers.linear import QKVLinear
from cadence.lora.pool import blocks_needed
from cadence.lora.weights import AdapterWeights, ExpandPiece, LayerLora
from cadence.pb import shard_pb2 as pb
from cadence.shard.engine import Engine

MODEL = Path.home() / ".cache/cadence/models/SmolLM2-135M-Instruct-float32"


def qv_adapter(engine: Engine, name: str, rank: int, seed: int) -> AdapterWeights:
    """A random adapter of `rank` on every layer's q and v projections."""
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for layer_name, m in engine.model.named_modules():
        if not isinstance(m, QKVLinear):
            continue
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        a = (torch.randn(2 * rank, m.in_features, generator=g) * 0.02).to(engine.dtype)
        b_q = (torch.randn(rank, q, generator=g) * 0.02).to(engine.dtype)
        b_v = (torch.randn(rank, kv, generator=g) * 0.02).to(engine.dtype)
        pieces = (ExpandPiece(0, 0, b_q), ExpandPiece(q + kv, rank, b_v))
        layers[layer_name] = LayerLora(a, pieces)
    return AdapterWeights(name, "", layers, rank, ("q_proj", "v_proj"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 times the step in CPU time (the "
        "thread's own), which other processes sharing the cores do not inflate",
    )
    p.add_argument("--cpu-isa", help="the C++ kernels' instruction set (default $CADENCE_CPU_ISA)")
    p.add_argument(
        "--kv-mib",
        type=int,
        default=512,
        help="the KV pool, which holds the adapters too (float32 ones over a bfloat16 cache "
        "take twice the blocks)",
    )
    p.add_argument(
        "--torch-lora",
        action="store_true",
        help="the LoRA products through torch's gathers, not the C++ row kernels",
    )
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    isa_choice = a.cpu_isa or os.environ.get(cpu_isa.ENV, "auto")
    config = ShardConfig(
        model_dir=str(MODEL), uds_path="/unused", dtype=a.dtype, cpu_isa=isa_choice
    )
    engine = Engine(config)
    engine.warmup(1024, 64, a.kv_mib * 1024**2, 0.1)
    assert engine.kv is not None
    if a.torch_lora:
        engine.adapters.context.cpu_kernels = False
    lora_path = "C++ row kernels" if engine.adapters.context.cpu_kernels else "torch"
    free = list(range(engine.kv.num_blocks))
    names = [f"a{i}" for i in range(a.batch)]
    pages = []
    for i, name in enumerate(names):
        weights = qv_adapter(engine, name, a.rank, i)
        engine.adapters.keep(weights)
        n = blocks_needed(weights, engine.adapters.shape, engine.dtype)
        pages.append(pb.AdapterPages(name=name, blocks=[free.pop() for _ in range(n)]))
    engine.step(pb.StepRequest(adapters_in=pages))
    print(f"{a.batch} adapters of rank {a.rank} on q, v: {len(pages[0].blocks)} blocks each")
    per_request = (a.prompt + 2 * a.steps + 16) // 16 + 1

    def run(adapter_of: list[str], first_id: int) -> float:
        ids = range(first_id, first_id + a.batch)
        joined = [
            pb.NewRequest(
                id=i,
                token_ids=[(7 * i + j) % 40000 + 100 for j in range(a.prompt)],
                prompt_len=a.prompt,
                num_compute=a.prompt,
                block_table=[free.pop() for _ in range(per_request)],
                sampling=pb.SamplingParams(),
                adapter_id=adapter,
            )
            for i, adapter in zip(ids, adapter_of, strict=True)
        ]
        for k in range(0, a.batch, 8):
            engine.step(pb.StepRequest(joined=joined[k : k + 8]))
        decode = pb.StepRequest(continuing=[pb.ContinuingRequest(id=i, num_compute=1) for i in ids])
        for _ in range(3):
            engine.step(decode)
        times = []
        for _ in range(a.steps):
            started = clock()
            engine.step(decode)
            times.append(clock() - started)
        elapsed = sorted(times)[len(times) // 2] * 1000  # the median: robust to a busy CPU
        engine.step(pb.StepRequest(removed=list(ids)))
        free.extend(b for r in joined for b in r.block_table)
        return elapsed

    base, distinct, shared = [], [], []
    for k in range(a.rounds):  # alternated, so that a busy spell hits every setting
        base.append(run([""] * a.batch, 3000 * k))
        distinct.append(run(names, 3000 * k + 1000))
        shared.append(run([names[0]] * a.batch, 3000 * k + 2000))
    base, distinct, shared = min(base), min(distinct), min(shared)
    what = "CPU time" if a.threads == 1 else "wall time"
    isa = cpu_kernels.selected_isa()
    print(f"{cpu_isa.cpu_model()}, kernels {isa}, LoRA through {lora_path}")
    print(f"decode step, batch {a.batch}, {a.dtype}, {torch.get_num_threads()} threads ({what}):")
    print(f"  no adapter:               {base:.1f} ms")
    print(f"  {a.batch} distinct adapters:    {distinct:.1f} ms (+{distinct / base - 1:.0%})")
    print(f"  one adapter for all rows: {shared:.1f} ms (+{shared / base - 1:.0%})")


if __name__ == "__main__":
    main()

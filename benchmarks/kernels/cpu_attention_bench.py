"""The CPU paged decode attention alone: 30 layers' worth of scattered KV (SmolLM2's
shapes: 9 query heads over 3 KV heads of 64), one query per sequence, the C++ kernel
(`cadence.kernels.cpu`) against the torch backend's gather + SDPA. bfloat16 queries and
cache by default; `--dtype float32` for the servers that run in float32 (below
AVX512-BF16), with `--kv-dtype` for their cache: a float dtype, or a quantized cache
(int8, fp8_e4m3, fp8_e5m2: `cadence.kv_format`, read with its scales). $CADENCE_CPU_ISA
picks the kernels' build.

    PYTHONPATH=server python benchmarks/kernels/cpu_attention_bench.py [--batch 32] [--context 420]
        [--dtype float32] [--kv-dtype bfloat16] [--block-size 16]
        [--in-cache]   # every sequence and layer reads the same blocks: compute alone
        [--prefill]    # every token of --batch prompts of --context tokens a query
        [--cpu-time]   # time in CPU seconds of this process, not wall time
        [--threads 1]  # the kernels' threads (default: torch's)

The C++ kernel's line gives the mean of --steps calls, then their fastest and median
(each call timed alone), which move less on a shared machine.
"""

from __future__ import annotations

import argparse

import torch
from cadence.attention_backends.torch_sdpa import decode_attention
from cadence.kernels import cpu
from cadence.kv_cache import bytes_per_block
from cadence.kv_format import kv_format, quantize

# The same timing (run as a script, this folder is on sys.path).
from cpu_decode_step import call_times, clock_of, timed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=420)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", help="the queries' and outputs' dtype")
    p.add_argument("--kv-dtype", default=None, help="the cache's dtype (default: --dtype)")
    p.add_argument(
        "--in-cache", action="store_true",
        help="every sequence and layer reads the same blocks (they stay in L2): compute alone",
    )  # fmt: skip
    p.add_argument("--cpu-time", action="store_true", help="CPU time instead of wall time")
    p.add_argument("--threads", type=int, default=0, help="the kernels' threads (0: torch's)")
    p.add_argument(
        "--prefill", action="store_true",
        help="batch-invariant prefill: every token of --batch prompts of --context tokens is "
        "a query over the context up to itself (the C++ kernel alone)",
    )  # fmt: skip
    a = p.parse_args()
    clock = clock_of(a.cpu_time)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    cpu.select()  # $CADENCE_CPU_ISA, else the best this CPU runs: defines the operators
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    fmt = kv_format(a.kv_dtype or a.dtype)
    b, n, bs = a.batch, a.context, a.block_size
    per_seq = -(-n // bs)
    q = torch.randn(b, 9, 64).to(dtype)
    layer_scale = torch.tensor([0.02])

    def cache(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        stored, token_scales = quantize(torch.randn(shape), fmt, layer_scale)
        return stored, token_scales if token_scales is not None else (
            layer_scale if fmt.quantized else None
        )

    def layer(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        (k, ks), (v, vs) = cache(shape), cache(shape)
        return k, v, ks, vs

    if a.in_cache:  # one pool of one sequence's blocks, shared by every sequence and layer
        caches = [layer((per_seq + 8, bs, 3, 64))] * a.layers
        tables = torch.arange(per_seq).repeat(b, 1)
    else:
        caches = [layer((b * per_seq + 8, bs, 3, 64)) for _ in range(a.layers)]
        tables = torch.randperm(b * per_seq).view(b, per_seq).long()  # scattered blocks
    lens = torch.full((b,), n)
    if a.prefill:  # each prompt's tokens: rows of its table, contexts 1..n
        rows = torch.arange(b).repeat_interleave(n)
        tables, lens = tables[rows], torch.arange(1, n + 1).repeat(b)
        q = torch.randn(b * n, 9, 64).to(dtype)
    times = call_times(
        lambda: [
            cpu.paged_decode_attention(q, k, v, tables, lens, 0.125, k_scale=ks, v_scale=vs)
            for k, v, ks, vs in caches
        ],
        a.steps,
        clock,
    )
    t_kernel = sum(times) / len(times)
    spread = f"(fastest {times[0]:.1f}, median {times[len(times) // 2]:.1f} ms)"
    if a.prefill:
        print(f"{a.layers} layers, {b} prompts of {n} tokens, every token a query, "
              f"{torch.get_num_threads()} threads: {t_kernel:.1f} ms "
              f"({b * n / t_kernel * 1000:.0f} tokens/s) {spread}")  # fmt: skip
        return
    mask = (torch.arange(per_seq * bs) < lens.unsqueeze(1)).view(b, 1, 1, -1)
    kv_mb = b * n * bytes_per_block(a.layers, 1, 3, 64, fmt) / 1e6  # scales included
    t_torch = timed(
        lambda: [
            decode_attention(q, k, v, tables, mask, 0.125, k_scale=ks, v_scale=vs)
            for k, v, ks, vs in caches
        ],
        a.steps,
        clock,
    )
    print(
        f"{a.layers} layers, batch {b}, context {n}, {a.dtype} queries over a "
        f"{a.kv_dtype or a.dtype} cache, {cpu.selected_isa()} kernels: {kv_mb:.0f} MB of KV read"
    )
    print(f"C++ kernel       {t_kernel:6.1f} ms  ({kv_mb / t_kernel:.1f} GB/s) {spread}")
    print(f"gather + SDPA    {t_torch:6.1f} ms  ({kv_mb / t_torch:.1f} GB/s)")


if __name__ == "__main__":
    main()

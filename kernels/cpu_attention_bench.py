"""The CPU paged decode attention alone: 30 layers' worth of scattered bfloat16 KV
(SmolLM2's shapes: 9 query heads over 3 KV heads of 64), one query per sequence, the C++
kernel (`cadence.kernels.cpu`) against the torch backend's gather + SDPA.

    PYTHONPATH=server python kernels/cpu_attention_bench.py [--batch 32] [--context 420]
        [--in-cache]   # every sequence and layer reads the same blocks: compute alone
"""

from __future__ import annotations

import argparse

import torch
from cadence.kernels import cpu
from cadence.layers.attention import decode_attention
from cpu_decode_step import timed  # the same timing loop (run as a script from kernels/)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=420)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--in-cache", action="store_true",
        help="every sequence and layer reads the same blocks (they stay in L2): compute alone",
    )  # fmt: skip
    a = p.parse_args()
    torch.manual_seed(0)
    b, n, bs = a.batch, a.context, 16
    per_seq = -(-n // bs)
    q = torch.randn(b, 9, 64).bfloat16()
    if a.in_cache:  # one pool of one sequence's blocks, shared by every sequence and layer
        shape = (per_seq + 8, bs, 3, 64)
        caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16())] * a.layers
        tables = torch.arange(per_seq).repeat(b, 1)
    else:
        shape = (b * per_seq + 8, bs, 3, 64)
        caches = [
            (torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(a.layers)
        ]
        tables = torch.randperm(b * per_seq).view(b, per_seq).long()  # scattered blocks
    lens = torch.full((b,), n)
    mask = (torch.arange(per_seq * bs) < lens.unsqueeze(1)).view(b, 1, 1, -1)
    kv_mb = a.layers * b * n * 3 * 64 * 2 * 2 / 1e6
    t_kernel = timed(
        lambda: [cpu.paged_decode_attention(q, k, v, tables, lens, 0.125) for k, v in caches],
        a.steps,
    )
    t_torch = timed(
        lambda: [decode_attention(q, k, v, tables, mask, 0.125) for k, v in caches], a.steps
    )
    print(f"{a.layers} layers, batch {b}, context {n}: {kv_mb:.0f} MB of KV read")
    print(f"C++ kernel       {t_kernel:6.1f} ms  ({kv_mb / t_kernel:.1f} GB/s)")
    print(f"gather + SDPA    {t_torch:6.1f} ms  ({kv_mb / t_torch:.1f} GB/s)")


if __name__ == "__main__":
    main()

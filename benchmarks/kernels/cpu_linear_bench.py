"""SmolLM2's linear layers on CPU, 30 layers' worth of distinct weights (so they stream
from memory as in a real step) plus the LM head: oneDNN with the weight prepacked
(`cadence.layers.packed`) against `F.linear`, per batch size. Decided up to how many
rows bfloat16 weights are used packed (`BF16_PACKED_MAX_ROWS`), and that float32 ones
always are. `ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` holds both libraries
to what an AVX2-only CPU runs.

    python benchmarks/kernels/cpu_linear_bench.py [--threads 2] [--rows 1,32,96,256,352,512,1024]
        [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
LAYERS = 30
VOCAB = 49152


def best_ms(fn: Callable[[], None], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def run(layers: list[list[torch.Tensor]], inputs: dict[int, torch.Tensor], prepacked: bool) -> None:
    for ws in layers:
        for w in ws:  # a packed weight keeps its logical [out, in] shape
            x = inputs[w.shape[1]]
            if prepacked:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            else:
                F.linear(x, w)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,32,96,256,352,512,1024")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
    weights.append([torch.randn(VOCAB, 576).to(dtype)])
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for ws in weights]
    total = sum(w.numel() * w.element_size() for ws in weights for w in ws)

    for rows in (int(r) for r in a.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        t_packed = best_ms(lambda x=inputs: run(packed, x, prepacked=True))
        t_plain = best_ms(lambda x=inputs: run(weights, x, prepacked=False))
        print(
            f"rows {rows:5d}: packed {t_packed:7.1f} ms ({total / t_packed / 1e6:5.1f} GB/s)"
            f"  F.linear {t_plain:7.1f} ms  ({t_plain / t_packed:.2f}x)"
        )


if __name__ == "__main__":
    main()

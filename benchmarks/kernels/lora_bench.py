r"""The Triton LoRA products (`cadence.kernels.lora`) against their torch definition
(`cadence.kernels.reference`, a gather then a matmul per adapter) on a GPU: one fused
q/k/v layer of a Llama-8B-sized model (hidden 4096, outputs 4096 + 1024 + 1024), its
adapters paged into a pool at scattered rows, for decode batches (rows of different
adapters, taken one by one), prefill chunks (segments) and a mix of both. Per workload:
shrink + three expands, time per layer and the GB/s of the bytes it must move (x, the
adapters' A and Bᵀ rows, h, y read and written).

    PYTHONPATH=server python benchmarks/kernels/lora_bench.py [--rank 16] [--adapters 8] \
        [--dtype bfloat16]

Without a GPU it says so and exits 0 (the kernels' tests run under the interpreter).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

HIDDEN = 4096
PIECES = [(4096, 0), (1024, 4096), (1024, 5120)]  # q, k, v: width, column in y
Y_WIDTH = 6144
GB = 1e9

Runs = list[tuple[int, int, int]]


def workloads(adapters: int) -> dict[str, Runs]:
    """name -> (start, end, adapter) runs of the step's rows."""
    decode = {
        f"decode {n} rows": [(t, t + 1, t % adapters) for t in range(n)] for n in (16, 64, 256)
    }
    prefill = [(512 * c, 512 * c + 512, c % adapters) for c in range(4)]
    mixed = [(256 * c, 256 * c + 256, c % adapters) for c in range(2)]
    mixed += [(512 + t, 513 + t, t % adapters) for t in range(64)]
    return {**decode, "prefill 4 x 512 rows": prefill, "mixed 2 x 256 + 64 rows": mixed}


@dataclass(frozen=True)
class PagedAdapters:
    rows_in: torch.Tensor
    rows_out: dict[int, torch.Tensor]  # by width
    a_idx: torch.Tensor
    ranks: torch.Tensor
    b_idx: list[torch.Tensor]
    piece_ranks: torch.Tensor
    rank_start: list[torch.Tensor]


def paged_adapters(adapters: int, rank: int, dtype: torch.dtype) -> PagedAdapters:
    """A pool holding every adapter's A ([3·rank, 4096]) and Bᵀ per piece at shuffled rows
    of their width, in separate regions; the index tables and ranks the kernels take."""
    stacked = 3 * rank
    a_rows = adapters * stacked
    b_rows = [adapters * rank for _ in PIECES]
    regions = [a_rows * HIDDEN] + [n * w for n, (w, _) in zip(b_rows, PIECES, strict=True)]
    flat = torch.randn(sum(regions), device="cuda", dtype=dtype) * 0.01
    cuda = {"device": "cuda", "dtype": torch.int32}

    def rows_at(region: int, width: int, count: int) -> torch.Tensor:
        first = sum(regions[:region]) // width
        return (first + torch.randperm(count, device="cuda")).to(torch.int32)

    a_idx = rows_at(0, HIDDEN, a_rows).view(adapters, stacked)
    b_idx = [rows_at(p + 1, w, b_rows[p]).view(adapters, rank) for p, (w, _) in enumerate(PIECES)]
    ranks = torch.full((adapters,), stacked, **cuda)
    piece_ranks = torch.full((adapters,), rank, **cuda)
    starts = [torch.full((adapters,), p * rank, **cuda) for p in range(len(PIECES))]
    return PagedAdapters(
        flat[: flat.numel() // HIDDEN * HIDDEN].view(-1, HIDDEN),
        {w: flat[: flat.numel() // w * w].view(-1, w) for w, _ in PIECES},
        a_idx,
        ranks,
        b_idx,
        piece_ranks,
        starts,
    )


def bench_workload(
    name: str, runs: Runs, paged: PagedAdapters, rank: int, dtype: torch.dtype
) -> None:
    from bench import cuda_ms
    from cadence.kernels.lora import lora_expand_, lora_shrink, plan_rows
    from cadence.kernels.reference import lora_expand_ref_, lora_shrink_ref
    from cadence.lora.products import ExpandTables, ShrinkTables

    rows = runs[-1][1]
    row_adapter = torch.empty(rows, device="cuda", dtype=torch.int32)
    for start, end, adapter in runs:
        row_adapter[start:end] = adapter
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype)
    y = torch.zeros(rows, Y_WIDTH, device="cuda", dtype=dtype)
    plan = plan_rows(rows, runs, "cuda")  # once per step, outside the timing
    p = paged
    shrink = ShrinkTables(p.rows_in, p.a_idx, p.ranks, row_adapter)
    expands = [
        ExpandTables(p.rows_out[w], p.b_idx[i], p.piece_ranks, p.rank_start[i], col, row_adapter)
        for i, (w, col) in enumerate(PIECES)
    ]

    def triton_layer() -> None:
        h = lora_shrink(x, shrink, plan)
        for expand in expands:
            lora_expand_(y, h, expand, plan)

    def torch_layer() -> None:
        h = lora_shrink_ref(x, shrink)
        for expand in expands:
            lora_expand_ref_(y, h, expand)

    esize = torch.finfo(dtype).bits // 8
    used = len({adapter for _, _, adapter in runs})
    weights = used * 3 * rank * (HIDDEN + Y_WIDTH) * esize
    moved = weights + rows * (HIDDEN + 2 * 3 * rank + 2 * Y_WIDTH) * esize
    ms = cuda_ms(triton_layer)
    ref_ms = cuda_ms(torch_layer, 10)
    rate = moved / (ms / 1000) / GB
    print(f"{name:26s} {ms * 1000:8.1f}us {ref_ms * 1000:8.1f}us {ref_ms / ms:7.1f}x {rate:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16, help="rank of each of q, k, v")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("lora_bench.py times the Triton kernels on a GPU; there is none here.")
        return
    dtype = getattr(torch, args.dtype)
    paged = paged_adapters(args.adapters, args.rank, dtype)
    print(f"{args.adapters} adapters, rank {args.rank} per piece, {args.dtype}")
    print(f"{'workload':26s} {'triton':>10s} {'torch ref':>10s} {'speedup':>8s} {'GB/s':>8s}")
    for name, runs in workloads(args.adapters).items():
        bench_workload(name, runs, paged, args.rank, dtype)


if __name__ == "__main__":
    main()

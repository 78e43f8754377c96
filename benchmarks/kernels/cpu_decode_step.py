"""One SmolLM2 decode step on CPU through the paged cache, with the `cpu` backend (the C++
kernel reading blocks in place) and the `torch` backend (gather + SDPA), against the
same step with contiguous (non-paged) attention: per-sequence K/V already laid out
[B, kv_heads, L, head_dim], the new token written in place, no block tables. The `cpu`
backend runs the flat decode loop (`cadence.runners.llama_cpu_flat`) by default; its
last line runs it through the model's modules instead, as every other variant runs
(prepacked linears, fused norms when the C++ kernels are built), which is the
like-for-like comparison of paged against contiguous attention.

    PYTHONPATH=server python benchmarks/kernels/cpu_decode_step.py --batch 32 --context 350
        [--kv-dtype int8]   # the cache's format (cadence.kv_format; default: --dtype)
        [--cpu-time]        # time in CPU seconds of this process, not wall time
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from cadence.attention_backends import StepLayout, forward_context
from cadence.attention_backends.base import Workspace
from cadence.attention_backends.cpu_paged import CpuAttention
from cadence.attention_backends.torch_sdpa import TorchAttention
from cadence.kernels import cpu
from cadence.kv_format import kv_format, quantize
from cadence.layers import attention as attn_mod
from cadence.layers import kernel_ops
from cadence.layers.packed import pack_linear_weights
from cadence.models import load_model
from cadence.runners import LlamaCpuFlatRunner, ModelRunner

MODEL = Path.home() / ".cache/cadence/models/SmolLM2-135M-Instruct"


def timed(fn, steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds per call of fn by `clock`, the mean of `call_times`: wall time, or with
    time.process_time the CPU time of every thread of this process, which other jobs on a
    shared machine inflate less."""
    return sum(call_times(fn, steps, clock)) / steps


def call_times(fn, steps: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Milliseconds of each of `steps` calls of fn, timed one by one after one to warm the
    workspace and the allocator, sorted: their fastest and median hold still on a shared
    machine where their mean moves."""
    fn()
    times = []
    for _ in range(steps):
        started = clock()
        fn()
        times.append((clock() - started) * 1000)
    return sorted(times)


def clock_of(cpu_time: bool) -> Callable[[], float]:
    return time.process_time if cpu_time else time.perf_counter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=350)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-dtype", default=None, help="the cache's format (default: --dtype)")
    p.add_argument("--cpu-time", action="store_true", help="CPU time instead of wall time")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    fmt = kv_format(a.kv_dtype or a.dtype)
    clock = clock_of(a.cpu_time)
    torch.manual_seed(0)
    model = load_model(str(MODEL), dtype, torch.device("cpu"))
    pack_linear_weights(model)
    layers = model.attention_layers()
    cfg = model.config
    b, n, bs = a.batch, a.context, a.block_size
    blocks_per_seq = (n + bs) // bs + 1
    num_blocks = b * blocks_per_seq + 1
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    layer_scale = torch.tensor([0.02])  # an fp8 cache's; int8 carries its own per token
    for layer in layers:
        layer.k_cache, k_scale = quantize(torch.randn(shape), fmt, layer_scale)
        layer.v_cache, v_scale = quantize(torch.randn(shape), fmt, layer_scale)
        if fmt.scales == "layer":
            k_scale, v_scale = layer_scale, layer_scale
        layer.k_scale, layer.v_scale = k_scale, v_scale
    # each sequence's blocks scattered over the pool, as after churn
    tables = (torch.randperm(num_blocks - 1)[: b * blocks_per_seq] + 1).view(b, -1)
    lens = torch.full((b,), n + 1)
    slots = tables[:, n // bs] * bs + n % bs
    ids = torch.randint(0, cfg.vocab_size, (b,))
    pos = torch.full((b,), n)
    layout = StepLayout(
        slot_mapping=slots, query_start=torch.arange(b + 1), context_lens=lens,
        block_tables=tables, block_size=bs, num_decode=b, max_query_len=1,
        decode_blocks=(n + bs) // bs, prefill_blocks=0,
    )  # fmt: skip
    runners: dict[str, ModelRunner] = {"torch": ModelRunner(model, TorchAttention(Workspace()))}
    if cpu.available():
        kernel_ops.bind(model, kernel_ops.cpu_ops(cpu.selected_isa() or ""))
        runners["cpu"] = LlamaCpuFlatRunner(model, CpuAttention(Workspace()))
        # the cpu backend through the model's modules, as the other backends run
        runners["cpu, module forward"] = ModelRunner(model, runners["cpu"].attention)

    def paged(backend: str) -> None:
        with torch.inference_mode():
            runners[backend].forward(layout, ids, pos)

    # contiguous: every layer's K/V as [B, kv_heads, L, head_dim]; the step writes its
    # token at position n and attends over n + 1 keys with no mask
    kv_shape = (b, cfg.num_kv_heads, n + 1, cfg.head_dim)
    contiguous_kv = {
        id(x): (torch.randn(kv_shape).to(dtype), torch.randn(kv_shape).to(dtype)) for x in layers
    }

    def contiguous_forward(self, q, k, v):
        kc, vc = contiguous_kv[id(self)]
        kc[:, :, n] = k
        vc[:, :, n] = v
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kc, vc, scale=self.scale, enable_gqa=True
        )
        return out.reshape(q.shape[0], -1)

    def contiguous() -> None:
        original = attn_mod.Attention.forward
        attn_mod.Attention.forward = contiguous_forward
        torch_runner = runners["torch"]
        try:
            with torch.inference_mode():
                meta = torch_runner.attention.metadata(layout)
                with forward_context(torch_runner.attention, meta):
                    model(ids, pos)
        finally:
            attn_mod.Attention.forward = original

    print(
        f"torch threads {torch.get_num_threads()}, batch {b}, context {n}, block {bs}, "
        f"{a.dtype}, {fmt.name} cache{', CPU time' if a.cpu_time else ''}"
    )
    t_contig = timed(contiguous, a.steps, clock)
    print(f"contiguous decode step           {t_contig:7.1f} ms")
    for backend in ("cpu", "cpu, module forward", "torch"):
        if backend not in runners:
            continue
        t = timed(lambda backend=backend: paged(backend), a.steps, clock)
        print(
            f"paged decode step, {backend:5} backend {t:7.1f} ms  (/contiguous {t / t_contig:.2f}x)"
        )


if __name__ == "__main__":
    main()

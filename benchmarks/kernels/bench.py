r"""Kernel and decode-step benchmarks on a GPU: per kernel and size, time, achieved GB/s
and the fraction of the device's measured memory bandwidth (a device-to-device copy);
then one decode step of a model against its roofline (weight + KV bytes / bandwidth).

    PYTHONPATH=server python benchmarks/kernels/bench.py                  # kernels
    PYTHONPATH=server python benchmarks/kernels/bench.py \
        --model ~/.cache/cadence/models/SmolLM2-135M-Instruct
"""

# ruff: noqa: B023 (each lambda is timed at once, inside its loop iteration)

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from cadence.kernels.decode_attention import decode_attention
from cadence.kernels.kv_write import kv_write
from cadence.kernels.prefill_attention import prefill_attention
from cadence.kernels.rmsnorm import rmsnorm
from cadence.kernels.rotary import rotary_

GB = 1e9


def cuda_ms(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measured_bandwidth() -> float:
    """Bytes/s of a 1 GiB device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / (ms / 1000)


def report(name: str, size: str, ms: float, nbytes: int, bw: float) -> None:
    rate = nbytes / (ms / 1000)
    print(f"{name:16s} {size:34s} {ms * 1000:9.1f} us {rate / GB:8.1f} GB/s {rate / bw:6.1%}")


def paged(batch: int, ctx: int, kv_heads: int, dim: int, bs: int, dtype: torch.dtype):
    per_seq = (ctx + bs - 1) // bs
    blocks = batch * per_seq
    tables = torch.randperm(blocks, device="cuda").view(batch, per_seq).int()
    shape = (blocks, bs, kv_heads, dim)
    k = torch.randn(shape, device="cuda", dtype=dtype)
    return k, torch.randn_like(k), tables


def bench_kernels(bw: float, dtype: torch.dtype) -> None:
    esize = torch.finfo(dtype).bits // 8
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    for batch, ctx in [(1, 4096), (8, 4096), (32, 1024), (64, 2048), (256, 512), (4, 32768)]:
        k, v, tables = paged(batch, ctx, kv_heads, dim, bs, dtype)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        nbytes = 2 * batch * ctx * kv_heads * dim * esize + 2 * q.numel() * esize
        for splits in (1, None):
            ms = cuda_ms(
                lambda s=splits: decode_attention(q, k, v, tables, lens, dim**-0.5, None, s)
            )
            label = "decode" if splits == 1 else "decode split-kv"
            report(label, f"B={batch} ctx={ctx} H={heads}/{kv_heads} d={dim}", ms, nbytes, bw)
    for chunks, prefix in [(4, 2048), (1, 8192), (16, 512)]:
        k, v, tables = paged(chunks, prefix, kv_heads, dim, bs, dtype)
        q_len = 512
        q = torch.randn(chunks * q_len, heads, dim, device="cuda", dtype=dtype)
        starts = torch.arange(chunks + 1, device="cuda", dtype=torch.int32) * q_len
        lens = torch.full((chunks,), prefix, device="cuda", dtype=torch.int32)
        ms = cuda_ms(lambda: prefill_attention(q, k, v, tables, starts, lens, q_len, dim**-0.5))
        nbytes = 2 * chunks * prefix * kv_heads * dim * esize + 2 * q.numel() * esize
        flops = 4 * chunks * q_len * prefix * heads * dim
        report("prefill", f"{chunks}x{q_len} tok, ctx {prefix}", ms, nbytes, bw)
        print(f"{'':16s} {'':34s} {flops / (ms / 1000) / 1e12:9.1f} TFLOP/s")
    for tokens in (32, 4096):
        k, v, _ = paged(64, 1024, kv_heads, dim, bs, dtype)
        new_k = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=dtype)
        slots = torch.randperm(k.shape[0] * bs, device="cuda")[:tokens]
        ms = cuda_ms(lambda: kv_write(new_k, new_k, k, v, slots))
        report("kv write", f"{tokens} tokens", ms, 4 * new_k.numel() * esize, bw)
    for tokens, hidden in [(32, 4096), (8192, 4096)]:
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        r, w = torch.randn_like(x), torch.randn(hidden, device="cuda", dtype=dtype)
        ms = cuda_ms(lambda: rmsnorm(x, w, 1e-6, r))
        report("rmsnorm+residual", f"{tokens}x{hidden}", ms, 4 * x.numel() * esize, bw)
        qk = torch.randn(tokens, heads + kv_heads, dim, device="cuda", dtype=dtype)
        cos = torch.randn(tokens, dim, device="cuda", dtype=dtype)
        ms = cuda_ms(lambda: rotary_(qk, cos, cos))
        report("rotary", f"{tokens} tok {heads + kv_heads} heads", ms, 2 * qk.numel() * esize, bw)


def bench_decode_step(model_dir: str, batch: int, ctx: int, bw: float, dtype: torch.dtype) -> None:
    from cadence.attention_backends import StepLayout
    from cadence.attention_backends.triton_paged import TritonAttention
    from cadence.layers import kernel_ops
    from cadence.models import load_model
    from cadence.runners import ModelRunner

    model = load_model(model_dir, dtype, torch.device("cuda"))
    kernel_ops.bind(model, kernel_ops.triton_ops())  # as the engine binds them on CUDA
    runner = ModelRunner(model, TritonAttention())
    cfg, layers = model.config, model.attention_layers()
    bs = 16
    per_seq = (ctx + bs) // bs
    for layer in layers:
        layer.k_cache, layer.v_cache, tables = paged(
            batch, per_seq * bs, layer.num_kv_heads, cfg.head_dim, bs, dtype
        )
    lens = torch.full((batch,), ctx + 1, device="cuda")
    slots = tables[:, ctx // bs].long() * bs + ctx % bs
    layout = StepLayout(
        slot_mapping=slots,
        query_start=torch.arange(batch + 1, device="cuda"),
        context_lens=lens,
        block_tables=tables.long(),
        block_size=bs,
        num_decode=batch,
        max_query_len=1,
        decode_blocks=per_seq,
        prefill_blocks=0,
    )
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), ctx, device="cuda")

    def step() -> None:
        with torch.inference_mode():
            model.compute_logits(runner.forward(layout, ids, pos))

    ms = cuda_ms(step, 20)
    esize = torch.finfo(dtype).bits // 8
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * len(layers) * batch * (ctx + 1) * layers[0].num_kv_heads * cfg.head_dim * esize
    roofline = (weights + kv) / bw * 1000
    print(
        f"decode step B={batch} ctx={ctx}: {ms:.2f} ms, roofline {roofline:.2f} ms "
        f"(weights {weights / GB:.2f} GB + KV {kv / GB:.2f} GB), {ms / roofline:.2f}x roofline"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", help="a model folder: also benchmark its decode step")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA device (the kernel tests run on CPU)")
    dtype = getattr(torch, a.dtype)
    bw = measured_bandwidth()
    print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {bw / GB:.0f} GB/s")
    bench_kernels(bw, dtype)
    if a.model:
        bench_decode_step(str(Path(a.model).expanduser()), a.batch, a.context, bw, dtype)


if __name__ == "__main__":
    main()

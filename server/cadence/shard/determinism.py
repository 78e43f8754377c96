"""Whether a shard's outputs are batch-invariant, and the start-up check of its products.

Batch-invariant (`--deterministic`, the default): a request's logits, and so its tokens
and logprobs, are the same bits whatever else is in its step, however its prompt was
chunked, whether its prefix was computed or read from the prefix cache, and whether it
was preempted (recomputed or swapped) or had its tokens verified by speculation. On CPU
with the C++ kernels that holds by construction:

- attention: every query, prompt tokens included, is one paged-attention kernel call over
  its context as the cache holds it, in a fixed order (`CpuAttention.every_query_on_cache`);
- products: one kernel per layer at every row count -- no float copy above a quantized
  kernel's crossover, bfloat16 through oneDNN's prepacked weight at every row count. The
  integer product quantizes each row by itself and sums integers exactly; oneDNN's
  blocking is a library's choice, so `varying_product` checks every product shape of the
  model on its own layers at its first start on a machine (the answers are kept per
  machine, threads and library versions: `determinism_cache`), and keeps each kernel to
  the row counts where it agrees with itself: products of more than `max_rows` rows are
  split (oneDNN's bfloat16 product changes its path above ~350 rows on a Zen 4, and from
  33 rows on a Sapphire Rapids, where it runs on AMX: split into 32-row products there),
  products of fewer than `min_rows` padded (its float32 one at one row with K = 1536);
- norms, rotary, activation and sampling: C++ kernels that compute row by row;
- tensor parallelism: the all-reduce adds the ranks' parts in rank order
  (`cadence.layers.parallel.all_reduce_sum`).

Outside that (a GPU, torch's kernels) the flag is reported off with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger
from torch import nn

from cadence.attention_backends import AttentionBackend
from cadence.attention_backends.cpu_paged import CpuAttention
from cadence.config import ShardConfig
from cadence.kernels.cpu.selection import selected_isa
from cadence.layers.linear import product
from cadence.layers.packed import EVERY_ROW_COUNT, is_amx_packing, is_tile_packing
from cadence.shard.determinism_cache import CheckCache, default_cache

# Row counts the start-up check multiplies: one row, small batches, a vector or block tail
# (17, 33, 129), prefill chunks, and past the largest split (700). The LM head, the widest
# product, is split at HEAD_SPLIT rows (it multiplies one row per sampled token; only
# prompt logprobs give it more) and checked up to HEAD_ROWS.
CHECK_ROWS = (1, 2, 3, 5, 8, 16, 17, 33, 64, 129, 320, 333, 512, 700)
HEAD_SPLIT, HEAD_ROWS = 64, 100
OFFSET = 7  # the same rows again, at another place in the batch
# rows multiplied at each row count: a kernel whose float32 sums differ in their last bit
# changes a bfloat16 output in ~1 of 1000 elements, so few rows would miss it
WINDOW_ROWS = {False: 64, True: 16}  # by "is the LM head" (49152 outputs a row)
# the most rows a small product is padded to: a library may take another path (another
# ISA's kernel, AMX tiles) for small products up to a few dozen rows; padding one row to
# 64 costs little where the product reads its weight once either way
MAX_PAD = 64
# the splits tried, largest first, where neither padding nor a split above MAX_PAD agrees;
# 16 rows (one AMX or vector row tile) the fewest
SMALL_SPLITS = (256, 128, 64, 32, 16)
SPLIT = 512  # the most rows one float kernel call takes (prefill chunks above are split)
# The most rows one quantized product (or one of cadence's float32 tiles) takes: the integer
# product quantizes each row by itself and sums integers exactly, and the tiles sum each
# output in one fixed order, so a whole prefill step (--max-batch-tokens' default)
# is one call, not two and a copy joining them (4% of a 960-row step on a Zen 4); the
# check multiplies this many rows too, and splits below it where a kernel disagrees.
QUANTIZED_SPLIT = 1024


@dataclass(frozen=True, slots=True)
class Determinism:
    on: bool
    detail: str  # what holds, or why it does not

    def describe(self) -> str:
        """What /info's kernels.determinism shows."""
        return f"{'on' if self.on else 'off'}: {self.detail}"


def off_reason(cfg: ShardConfig, device: torch.device, attention: AttentionBackend[Any]) -> str:
    """Why this shard cannot be batch-invariant ("" when it can)."""
    if not cfg.deterministic:
        return "turned off (--no-deterministic)"
    if device.type != "cpu":
        return f"not guaranteed on {device.type} (its kernels block by batch size)"
    if not isinstance(attention, CpuAttention) or not attention.every_query_on_cache:
        return f"needs the C++ CPU kernels' attention (serving: {attention.description})"
    return ""


def crossover_reason(model: nn.Module) -> str:
    """Why products switch kernels by row count ("" when none does): a float copy kept for
    large products (`--quantize-keep-float on` asks for one)."""
    for name, module in model.named_modules():
        quantized = getattr(module, "quantized", None)
        if quantized is not None and quantized.switches_by_rows:
            return (
                f"{name}: products above {quantized.crossover} rows take the float copy "
                "(--quantize-keep-float on)"
            )
    return ""


def _in_features(module: nn.Module) -> int:
    return int(getattr(module, "in_features", 0) or getattr(module, "hidden_size", 0))


def _path(module: nn.Module, rows: int) -> str:
    """Which kernel serves `module` for products of `rows` rows (the check's key: one check
    per kernel and shape)."""
    quantized = getattr(module, "quantized", None)
    if quantized is not None and quantized.serves(rows):
        return "quantized " + ",".join(quantized.formats)
    packed = getattr(module, "packed_weight", None)
    if packed is None:
        return "torch"
    if is_amx_packing(packed):
        return "amx bf16 tiles"
    return "float tiles" if is_tile_packing(packed) else "packed"


def _rows_vary(module: nn.Module, x: torch.Tensor, counts: tuple[int, ...], window: int) -> int:
    """The first of `counts` at which some row's product differs from the same row's in the
    product of all of `x`; 0 when none does. Each count multiplies at least `window` rows,
    in consecutive products of that many rows and again OFFSET rows further."""
    whole = product(module, x, None)
    for m in counts:
        for start in range(0, max(window - m, 0) + 1, m):
            for s in (start, start + OFFSET):
                if not torch.equal(product(module, x[s : s + m], None), whole[s : s + m]):
                    return m
    return 0


def _agreeing_range(
    module: nn.Module, x: torch.Tensor, counts: tuple[int, ...], split: int, window: int
) -> tuple[int, int] | None:
    """(min_rows, max_rows) for `module`'s products under which every count checked gives
    each row the same bits: no padding and `split`, else padding small products past the
    count that failed, or splitting below a large one; None when that does not converge."""
    module.min_rows, module.max_rows = 1, split
    for _ in range(len(counts)):
        failed = _rows_vary(module, x, counts, window)
        if not failed:
            return module.min_rows, module.max_rows
        if failed <= MAX_PAD:
            module.min_rows = min(m for m in (*counts, MAX_PAD + 1) if m > failed)
            if module.min_rows > MAX_PAD:
                break
        else:
            smaller = [m for m in counts if m < failed and m >= MAX_PAD]
            if not smaller:
                break
            module.max_rows = max(smaller)
    # Neither converged: the kernel may still agree with itself on smaller products, the
    # largest such split wins (oneDNN's bfloat16 product on a Sapphire Rapids' AMX: every
    # count up to 32 rows alike, and other bits from 33 rows on).
    for rows in SMALL_SPLITS:
        module.min_rows, module.max_rows = 1, rows
        if rows < split and not _rows_vary(module, x, counts, window):
            return module.min_rows, module.max_rows
    module.min_rows, module.max_rows = 1, split
    return None


def packed_split(dtype: torch.dtype, shape: tuple[int, int] = (960, 576)) -> int:
    """The most rows per call under which oneDNN's prepacked product of `dtype` gives a row
    the same bits whatever the other rows, as the start-up check finds it for a weight of
    `shape` (out, in): the split batch-invariant serving applies to it. SPLIT where it agrees
    at every count checked, 0 where no split does (the shard then serves it unsplit, not
    batch-invariant)."""
    from types import SimpleNamespace

    from cadence.layers.packed import onednn_packing

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(*shape, generator=generator) * 0.05).to(dtype)
    stand_in = SimpleNamespace(
        weight=weight,
        packed_weight=onednn_packing(weight),
        packed_max_rows=EVERY_ROW_COUNT,
        quantized=None,
        min_rows=1,
        max_rows=SPLIT,
    )
    x = torch.randn(max(CHECK_ROWS) + OFFSET, shape[1], generator=generator).to(dtype)
    found = _agreeing_range(stand_in, x, CHECK_ROWS, SPLIT, WINDOW_ROWS[False])
    return found[1] if found else 0


def varying_product(model: nn.Module, dtype: torch.dtype, known: CheckCache | None = None) -> str:
    """Multiplies random rows through each distinct product of `model` (kernel, shape) at
    the row counts of CHECK_ROWS, padding the products of a kernel that needs it (its
    layers' `min_rows`); names the first whose rows depend on the row count even so (""
    when none does). `known`: this machine's earlier answers, read instead of checking
    again (and the new ones added)."""
    generator = torch.Generator().manual_seed(0)
    ranges: dict[str, tuple[int, int]] = {}  # by product: kernel path and shape
    for name, module in model.named_modules():
        if not hasattr(module, "packed_weight"):
            continue  # not a product layer (LinearBase, ParallelLMHead)
        cols = _in_features(module)
        if cols == 0:
            continue
        head = not hasattr(module, "in_features")
        path = _path(module, 1)  # every row count's: crossover_reason ruled switching out
        # a row's bits fixed by construction
        own = path.startswith(("quantized", "float tiles", "amx bf16 tiles"))
        split = HEAD_SPLIT if head else QUANTIZED_SPLIT if own else SPLIT
        counts = tuple(m for m in CHECK_ROWS if m <= HEAD_ROWS) if head else CHECK_ROWS
        counts += (split,) if split > max(counts) else ()
        # the head has no out_features: its vocabulary slice is its outputs
        outputs = int(getattr(module, "out_features", 0) or getattr(module, "shard_size", 0))
        key = f"{path}, {cols} columns, {outputs} outputs, {split} split"
        if key not in ranges:
            cached, found = known.get(key) if known is not None else (False, None)
            if not cached:
                x = torch.randn(max(counts) + OFFSET, cols, generator=generator).to(dtype)
                found = _agreeing_range(module, x, counts, split, WINDOW_ROWS[head])
                if known is not None:
                    known.put(key, found)
            if found is None:
                return f"{name} ({path}): a row's product changes with the row count"
            ranges[key] = found
            if found != (1, split):
                kept = f"{found[0]}..{found[1]} rows"
                logger.info(f"{path} products of {cols} columns kept to {kept}")
        module.min_rows, module.max_rows = ranges[key]
    return ""


def decide(
    cfg: ShardConfig,
    device: torch.device,
    attention: AttentionBackend[Any],
    model: nn.Module,
    dtype: torch.dtype,
) -> Determinism:
    """Whether this shard serves batch-invariant outputs (logged when asked for and not)."""
    reason = off_reason(cfg, device, attention) or crossover_reason(model)
    if not reason:
        known = default_cache(selected_isa() or "none", dtype)
        varying = varying_product(model, dtype, known)
        known.save()
        if varying:
            reason = f"the products are not batch-invariant on this CPU: {varying}"
            logger.warning(f"--deterministic does not hold here: {reason}")
    if reason:
        return Determinism(False, reason)
    return Determinism(
        True,
        "attention of every query over the cache, one product kernel per layer at every "
        "row count (checked on this machine), row-wise norms and sampling",
    )

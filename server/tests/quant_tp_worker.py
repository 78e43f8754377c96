"""One tensor-parallel rank serving quantized models (spawned by
test_quant_tensor_parallel.py): joins a gloo group, loads each case -- a quantized
source (the whole checkpoint quantized, sliced by the rank) or `--quantize` at load (the
rank quantizes its own slice) -- and records the scripted run's logits.

Kept free of transformers imports so a spawned rank starts fast."""

from __future__ import annotations

from pathlib import Path

from tp_worker import run_cases, scripted_logits

# (case name, model folder, method, int4 group size, "source" or "at_load")
Case = tuple[str, str, str, int, str]


def engine_for_case(case: Case, rank: int = 0, world_size: int = 1, port: int = 0):
    import cadence.models
    from cadence.config import ShardConfig
    from cadence.shard.engine import Engine
    from quant_sources import QuantizedCopy

    _, model_dir, method, group, via = case
    cfg = ShardConfig(
        model_dir=model_dir, uds_path="", dtype="float32", rank=rank, world_size=world_size,
        master_port=port, quantize_keep_float="off",
    )  # fmt: skip
    opener = cadence.models.open_quantized_checkpoint
    if via == "source":
        source = QuantizedCopy(model_dir, method, group)
        cadence.models.open_quantized_checkpoint = lambda _: source
    else:
        cfg.quantize, cfg.quantize_group_size = method, group
    try:
        engine = Engine(cfg)
    finally:
        cadence.models.open_quantized_checkpoint = opener
    engine.warmup(max_batch_tokens=64, max_batch_size=8, kv_cache_bytes=1 << 20)
    return engine


def _rank_logits(case: Case, rank: int, world_size: int, port: int) -> dict:
    return scripted_logits(engine_for_case(case, rank, world_size, port))


def run_group(world_size: int, cases: list[Case], out_dir: Path) -> list[dict]:
    return run_cases(_rank_logits, world_size, cases, out_dir)

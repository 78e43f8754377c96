"""One tensor-parallel rank of the LoRA parsing tests (spawned by test_lora_peft.py): joins
a gloo group, builds each case's base model and the model with the adapter merged by PEFT
(both sliced by the rank's loaders), parses the adapter for the base model, and records
per adapted layer the delta its slices add and the merged weight's difference to the
base weight on this rank.

Free of transformers and peft imports at module level, so a spawned rank starts fast."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from tp_worker import free_port

# (case name, base model folder, merged model folder, adapter folder)
Case = tuple[str, str, str, str]


def rank_deltas(case: Case) -> dict[str, dict]:
    from cadence.layers.linear import LinearBase
    from cadence.lora.peft_adapter import load_peft_adapter
    from cadence.models import load_model
    from lora_helpers import dense_delta

    name, base_dir, merged_dir, adapter_dir = case
    base = load_model(base_dir, "float32", "cpu")
    merged = dict(load_model(merged_dir, "float32", "cpu").named_modules())
    weights = load_peft_adapter(name, adapter_dir, base, torch.float32)
    linear = {n: m for n, m in base.named_modules() if isinstance(m, LinearBase)}
    return {
        "delta": {
            layer: dense_delta(lora, linear[layer].out_features)
            for layer, lora in weights.layers.items()
        },
        "merged_minus_base": {n: merged[n].weight - m.weight for n, m in linear.items()},
    }


def run_rank(rank: int, world_size: int, port: int, cases: list[Case], out_dir: str) -> None:
    from cadence.config import ShardConfig
    from cadence.shard.engine import init_distributed

    torch.set_num_threads(1)
    init_distributed(
        ShardConfig(model_dir="", uds_path="", rank=rank, world_size=world_size, master_port=port)
    )
    try:
        results = {case[0]: rank_deltas(case) for case in cases}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(world_size: int, cases: list[Case], out_dir: Path) -> list[dict]:
    import torch.multiprocessing as mp

    mp.start_processes(
        _entry,
        args=(world_size, free_port(), cases, str(out_dir)),
        nprocs=world_size,
        start_method="spawn",
    )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


def _entry(rank: int, *args: object) -> None:
    run_rank(rank, *args)  # type: ignore[arg-type]

"""LoRA adapters under tensor parallelism (gloo, 2 ranks): each rank pages in its slices
(column-parallel layers: B's rows of its outputs; row-parallel: A's columns of its
inputs, the delta added before the all-reduce), and the logits of requests of mixed
adapters are one rank's, on every rank."""

from __future__ import annotations

import pytest
import torch
from lora_script import REQUESTS, mixed_run
from tp_worker import run_group

FAMILIES = ["llama_gqa", "llama_kv1_odd_vocab", "opt", "gpt2"]


@pytest.fixture(scope="module")
def two_ranks(model_dirs, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    dirs = [str(model_dirs(name)) for name in FAMILIES]
    return run_group(2, dirs, tmp_path_factory.mktemp("lora-tp2"), "float32", "lora")


@pytest.mark.parametrize("name", FAMILIES)
def test_two_ranks_give_one_ranks_logits(name, two_ranks, model_dirs, engine_for):
    one, _ = mixed_run(engine_for(model_dirs(name)), with_adapters=True)
    for rank, results in enumerate(two_ranks):
        got = results[name]["lora"]
        for rid in REQUESTS:
            torch.testing.assert_close(
                got[rid], one[rid], atol=1e-4, rtol=0, msg=f"rank {rank} request {rid}"
            )

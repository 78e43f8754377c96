"""LoRA adapters served by the engine from the KV pool: requests of four adapters and of
none, mixed in the same prefill and decode steps, give the logits (and greedy tokens) of
an engine whose weights have the request's adapter merged in (W + Bᵀᵀ·A, from the same
adapter weights) -- for Llama through the flat CPU step and the generic forward, OPT and
GPT-2. Paging an adapter out and in again on other blocks changes nothing; KV written into
a paged-out adapter's blocks leaves the others alone; Step errors name the adapter."""

from __future__ import annotations

import pytest
import torch
from cadence.lora.pool import read_layer
from cadence.pb import shard_pb2
from cadence.runners import LlamaCpuFlatRunner, ModelRunner
from cadence.shard.adapters import AdapterRefused
from cadence.shard.step_checks import StepError
from lora_random import merge_into, random_adapter, ranks_by_part
from lora_script import ADAPTERS, REQUESTS, keep_adapters, mixed_run, page_in
from shard_helpers import MiniRouter

TOL = 1e-4


@pytest.fixture(scope="module")
def merged_logits(model_dirs, engine_for):
    """Per model: the script's logits on engines with each adapter merged (and none)."""
    cache: dict[str, dict[str, dict[int, torch.Tensor]]] = {}

    def get(name: str) -> dict[str, dict[int, torch.Tensor]]:
        if name not in cache:
            runs = {}
            for adapter in ["", *ADAPTERS]:
                engine = engine_for(model_dirs(name))
                if adapter:
                    weights = keep_adapters(engine)[adapter]
                    merge_into(engine.model, weights, repack=engine.cfg.cpu_kernels)
                runs[adapter] = mixed_run(engine, with_adapters=False)[0]
            cache[name] = runs
        return cache[name]

    return get


@pytest.mark.parametrize(
    ("name", "runner"),
    [
        ("llama_gqa", "flat"),
        ("llama_gqa", "generic"),
        ("llama_gqa", "triton"),
        ("opt", "generic"),
        ("gpt2", "generic"),
    ],
)
def test_mixed_adapters_match_merged_weights(name, runner, model_dirs, engine_for, merged_logits):
    if runner == "triton":  # the Triton attention and LoRA kernels (the interpreter on CPU)
        engine = engine_for(model_dirs(name), attention_backend="triton")
        assert engine.adapters.context.triton
    else:
        engine = engine_for(model_dirs(name))
    if runner == "flat":
        if not isinstance(engine.runner, LlamaCpuFlatRunner):
            pytest.skip("the flat Llama step needs the C++ CPU kernels")
    elif runner == "generic":
        engine.runner = ModelRunner(engine.model, engine.attention_backend)
    got, _ = mixed_run(engine, with_adapters=True)
    want = merged_logits(name)
    for rid, (adapter, _) in REQUESTS.items():
        ref = want[adapter][rid]
        assert got[rid].shape == ref.shape
        torch.testing.assert_close(got[rid], ref, atol=TOL, rtol=0, msg=f"request {rid}")
        assert torch.equal(got[rid].argmax(-1), ref.argmax(-1)), f"request {rid}"
        if adapter:  # the adapter changes the request's outputs
            assert (got[rid] - want[""][rid]).abs().max() > 100 * TOL, f"request {rid}"


def _one_request(router: MiniRouter, rid: int, adapter: str, tokens: list[int]) -> torch.Tensor:
    """A prefill and two decodes of one request with `adapter`; its logits."""
    new = router.join(rid, tokens)
    new.adapter_id = adapter
    got = [router.logits_step(joined=[new], forced={rid: 7})[rid]]
    for t in (8, 9):
        got.append(router.logits_step(continuing=[router.cont(rid)], forced={rid: t})[rid])
    router.step(removed=[router.remove(rid)])
    return torch.cat(got)


def test_paging_out_and_in_on_other_blocks_gives_the_same(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"))
    keep_adapters(engine)
    router = MiniRouter(engine)
    blocks = page_in(engine, router, ["y", "x"])
    tokens = list(range(10, 31))
    before = _one_request(router, 1, "y", tokens)
    engine.step(shard_pb2.StepRequest(adapters_out=["y"]))
    assert not engine.kv.blocks[:, :, blocks["y"]].any()  # zeroed for the KV cache
    moved = page_in(engine, router, ["y"])
    assert set(moved["y"]).isdisjoint(blocks["y"])
    assert torch.equal(_one_request(router, 2, "y", tokens), before)


def test_kv_written_into_freed_adapter_blocks_leaves_the_others_alone(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"))
    weights = keep_adapters(engine)
    router = MiniRouter(engine)
    blocks = page_in(engine, router, ["x", "y", "w"])
    tokens = list(range(40, 57))
    before = _one_request(router, 1, "y", tokens)
    engine.step(shard_pb2.StepRequest(adapters_out=["x"]))
    router.free += blocks["x"]  # the next request's KV goes there
    long = router.join(2, [(5 * i) % 240 + 3 for i in range(16 * len(blocks["x"]))])
    assert set(blocks["x"]) <= set(long.block_table)
    router.step(joined=[long])
    for name in ("y", "w"):
        paged = engine.adapters.resident.adapters[name]
        for layer, lora in weights[name].layers.items():
            a, bs = read_layer(paged.layers[layer], engine.adapters.context.pool)
            assert torch.equal(a, lora.a)
            assert all(torch.equal(b, p.b_t) for b, p in zip(bs, lora.pieces, strict=True))
    assert torch.equal(_one_request(router, 3, "y", tokens), before)


def test_masked_cache_reads_never_see_adapter_bytes(model_dirs, engine_for):
    """float32 weights over a bfloat16 cache: an adapter's float32 rows, read as bfloat16
    keys and values, hold NaNs. Decode rows of different lengths gathered by the torch
    backend (the shorter's block-table padding is read, then masked): the base requests'
    logits are those of an engine without the adapter."""
    runs = []
    for with_adapter in (True, False):
        engine = engine_for(
            model_dirs("llama_gqa"), kv_cache_dtype="bfloat16", attention_backend="torch"
        )
        router = MiniRouter(engine)
        if with_adapter:
            keep_adapters(engine)
            router.free.remove(0)  # padding entries read block 0: put the adapter there
            router.free.append(0)
            blocks = page_in(engine, router, ["y"])
            assert 0 in blocks["y"]
            rows = engine.kv.blocks[:, :, blocks["y"]]
            assert rows.isnan().any()  # the hazard is there
        else:
            router.free.remove(0)
        short, long = router.join(1, [5, 6, 7]), router.join(2, list(range(3, 60)))
        router.logits_step(joined=[short, long], forced={1: 9, 2: 9})
        runs.append(
            router.logits_step(continuing=[router.cont(1), router.cont(2)], forced={1: 4, 2: 4})
        )
    for rid in (1, 2):
        assert runs[0][rid].isfinite().all()
        torch.testing.assert_close(runs[0][rid], runs[1][rid], atol=0, rtol=0)


def test_step_errors_name_the_adapter(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"))
    keep_adapters(engine)
    router = MiniRouter(engine)
    page_in(engine, router, ["x"])
    unknown = router.join(1, [4, 5, 6])
    unknown.adapter_id = "y"  # host-loaded, not paged in
    with pytest.raises(StepError, match="request 1: adapter y is not paged in"):
        engine.step(shard_pb2.StepRequest(joined=[unknown]))
    with pytest.raises(StepError, match="adapter nope is not loaded"):
        engine.step(
            shard_pb2.StepRequest(adapters_in=[shard_pb2.AdapterPages(name="nope", blocks=[1])])
        )
    with pytest.raises(StepError, match="adapter y needs"):
        engine.step(
            shard_pb2.StepRequest(adapters_in=[shard_pb2.AdapterPages(name="y", blocks=[1])])
        )
    user = router.join(2, [4, 5, 6])
    user.adapter_id = "x"
    engine.step(shard_pb2.StepRequest(joined=[user]))
    with pytest.raises(StepError, match="adapter x is used by a held request"):
        engine.step(shard_pb2.StepRequest(adapters_out=["x"]))
    # paged in and joined in the same step; out once its request is removed
    late = router.join(3, [4, 5])
    late.adapter_id = "y"
    pages = shard_pb2.AdapterPages(name="y", blocks=[router.free.pop() for _ in range(8)])
    engine.step(shard_pb2.StepRequest(adapters_in=[pages], joined=[late]))
    engine.step(shard_pb2.StepRequest(removed=[router.remove(2)], adapters_out=["x"]))
    assert set(engine.adapters.resident.adapters) == {"y"}


def test_load_refusals_name_the_path_and_the_layer(model_dirs, engine_for, tmp_path):
    engine = engine_for(model_dirs("llama_gqa"))
    with pytest.raises(AdapterRefused, match=f"no adapter folder at {tmp_path / 'none'}"):
        engine.adapters.load("a", str(tmp_path / "none"))
    odd = random_adapter(engine.model, "odd", ranks_by_part({"q": 2}), engine.dtype)
    odd.layers["model.layers.9.mlp.nope"] = next(iter(odd.layers.values()))
    with pytest.raises(AdapterRefused, match="adapter odd: no linear layer model.layers.9"):
        engine.adapters.keep(odd)
    assert "odd" not in engine.adapters.host

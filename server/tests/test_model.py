"""Every model family through the paged KV cache gives transformers' logits, in every
dtype."""

from __future__ import annotations

import pytest
import torch
from cadence.config import ShardConfig
from cadence.models import load_model
from cadence.shard.engine import Engine
from shard_helpers import MiniRouter, hf_logits, prefill_then_decode_logits

TOL = 1e-4


@pytest.mark.parametrize(
    "variant",
    [
        "llama_gqa",
        "llama_mha_tied",
        "llama_bias",
        "llama3_rope",
        "qwen2",
        "qwen3",
        "llama_kv1_odd_vocab",
        "llama_9_heads_3_kv",
        "mistral_window",
        "qwen2_window",
        "opt",
        "opt_350m",
        "gpt2",
    ],
)
def test_prefill_and_ten_decode_steps_match_transformers(variant, model_dirs, hf_model, engine_for):
    path = model_dirs(variant)
    hf = hf_model(path)
    engine = engine_for(path)
    router = MiniRouter(engine)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 256, (21,), generator=g).tolist()
    future = torch.randint(3, 256, (10,), generator=g).tolist()
    full = prompt + future
    ref = hf_logits(hf, full)

    got = router.logits_step(joined=[router.join(1, prompt)], forced={1: future[0]})
    torch.testing.assert_close(got[1], ref[: len(prompt)], atol=TOL, rtol=0)
    for i in range(1, len(future)):
        got = router.logits_step(continuing=[router.cont(1)], forced={1: future[i]})
        pos = len(prompt) + i - 1
        torch.testing.assert_close(got[1], ref[pos : pos + 1], atol=TOL, rtol=0)


def test_chunked_prefill_in_three_chunks_matches_transformers(model_dirs, hf_model, engine_for):
    path = model_dirs("llama_gqa")
    hf, engine = hf_model(path), engine_for(path)
    router = MiniRouter(engine)
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, prompt + [5, 6])
    a = router.logits_step(joined=[router.join(1, prompt, num_compute=13)], forced={})
    b = router.logits_step(continuing=[router.cont(1, 12)], forced={})
    c = router.logits_step(continuing=[router.cont(1, 12)], forced={1: 5})
    d = router.logits_step(continuing=[router.cont(1)], forced={1: 6})
    got = torch.cat([a[1], b[1], c[1], d[1]])
    torch.testing.assert_close(got, ref[:38], atol=TOL, rtol=0)


def test_mixed_batch_of_prefills_and_decodes_matches_each_sequence_alone(
    model_dirs, hf_model, engine_for
):
    """Two requests prefill (one chunked) while two decode, at block-boundary lengths."""
    path = model_dirs("llama_gqa")
    hf, engine = hf_model(path), engine_for(path)
    router = MiniRouter(engine, seed=3)
    g = torch.Generator().manual_seed(3)
    lengths = {1: 16, 2: 33, 3: 15, 4: 17}
    prompts = {i: torch.randint(3, 256, (n,), generator=g).tolist() for i, n in lengths.items()}
    nxt = {i: torch.randint(3, 256, (4,), generator=g).tolist() for i in lengths}
    refs = {i: hf_logits(hf, prompts[i] + nxt[i]) for i in lengths}

    got: dict[int, list[torch.Tensor]] = {i: [] for i in lengths}
    # step 1: 1 and 2 prefill
    out = router.logits_step(
        joined=[router.join(1, prompts[1]), router.join(2, prompts[2])],
        forced={1: nxt[1][0], 2: nxt[2][0]},
    )
    assert router.last_batch is not None
    assert router.last_batch.layout.prefill_from_start  # whole prompts: the causal fast path
    for i in out:
        got[i].append(out[i])
    # step 2: 1 and 2 decode while 3 prefills whole and 4 prefills its first chunk
    out = router.logits_step(
        joined=[router.join(3, prompts[3]), router.join(4, prompts[4], num_compute=9)],
        continuing=[router.cont(1), router.cont(2)],
        forced={1: nxt[1][1], 2: nxt[2][1], 3: nxt[3][0]},
    )
    assert router.last_batch.layout.prefill_from_start  # a first chunk starts at 0 too
    for i in out:
        got[i].append(out[i])
    # steps 3-4: everyone goes on (4 finishes its prefill in step 3)
    for step in (2, 3):
        forced = {i: nxt[i][step] for i in (1, 2)}
        forced |= {3: nxt[3][step - 1], 4: nxt[4][step - 2]}
        out = router.logits_step(continuing=[router.cont(i) for i in (4, 3, 2, 1)], forced=forced)
        if step == 2:  # 4's second chunk attends to its cached first: the masked path
            assert not router.last_batch.layout.prefill_from_start
        for i in out:
            got[i].append(out[i])
    for i in lengths:
        mine = torch.cat(got[i])
        torch.testing.assert_close(mine, refs[i][: mine.shape[0]], atol=TOL, rtol=0)


def test_load_model_names_an_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'"):
        load_model(tmp_path, "float32", "cpu")


def test_bfloat16_weights_load_in_the_target_dtype(model_dirs, hf_model):
    path = model_dirs("llama_gqa")
    model = load_model(path, "bfloat16", "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    hf = hf_model(path)
    embed = hf.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(model.model.embed_tokens.weight, embed)


def test_sharded_checkpoints_load_through_their_index(model_dirs, hf_model, tmp_path):
    hf = hf_model(model_dirs("llama_gqa"))
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(tmp_path, "float32", "cpu")
    whole = load_model(model_dirs("llama_gqa"), "float32", "cpu")
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), whole.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("variant", "no_window"),
    [
        ("mistral_window", {"sliding_window": None}),
        ("qwen2_window", {"layer_types": ["full_attention"] * 2}),
    ],
)
def test_the_sliding_window_changes_the_logits(variant, no_window, model_dirs, engine_for):
    """The windowed tests above would pass vacuously if the window never bit: it does."""
    from transformers import AutoModelForCausalLM

    path = model_dirs(variant)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **no_window)
    tokens = torch.randint(3, 256, (31,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_then_decode_logits(engine_for(path), tokens, 21)
    unwindowed = hf_logits(full.eval(), tokens)[:30]
    assert (ours[8:] - unwindowed[8:]).abs().max() > 0.1  # beyond the window of 8


# (weights dtype, KV cache dtype, tolerance against transformers in the weights' dtype)
DTYPE_CASES = [
    ("bfloat16", None, 0.1),
    ("float16", None, 0.02),
    ("bfloat16", "float32", 0.1),
    ("float32", "bfloat16", 0.1),  # K/V rounded to bfloat16 in the cache
]


@pytest.mark.parametrize("variant", ["llama_gqa", "opt", "gpt2"])
@pytest.mark.parametrize(("dtype", "kv_dtype", "tol"), DTYPE_CASES)
def test_dtypes_match_transformers_in_the_same_dtype(variant, dtype, kv_dtype, tol, model_dirs):
    from transformers import AutoModelForCausalLM

    path = model_dirs(variant)
    engine = Engine(
        ShardConfig(model_dir=str(path), uds_path="", dtype=dtype, kv_cache_dtype=kv_dtype)
    )
    engine.warmup(64, 8, kv_cache_bytes=64 * engine.bytes_per_block)
    assert engine.kv is not None and engine.kv.blocks.dtype == getattr(torch, kv_dtype or dtype)
    assert {p.dtype for p in engine.model.parameters()} == {getattr(torch, dtype)}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tokens = torch.randint(3, 256, (31,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prefill_then_decode_logits(engine, tokens, 21)
    ref = hf_logits(hf, tokens)[:30]
    torch.testing.assert_close(ours, ref, atol=tol, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

"""The flat CPU forward step of the Llama family (`cadence.runners.llama_cpu_flat`, run by
`LlamaCpuFlatRunner`, the engine's runner on CPU) gives
the generic forward's bits: same hidden states and same KV cache contents, step after
step -- whole prompts, a prompt in two chunks (the second over its cached prefix), mixed
prefill + decode steps, decode-only steps across block boundaries and past a sliding
window -- in float32 and bfloat16, for every Llama variant (GQA, biases, Qwen2, sliding
windows, llama3 rope, SmolLM2's 9-in-3 heads, head_dim 64 for the vector paths). The
transformers-equivalence tests of test_model.py run through it too: it is the CPU
default."""

from __future__ import annotations

import random

import pytest
import torch
from cadence.pb import shard_pb2
from cadence.runners import LlamaCpuFlatRunner, ModelRunner, llama_cpu_flat
from shard_helpers import MiniRouter

pytestmark = pytest.mark.usefixtures("cpu_isa")  # every instruction set the CPU runs

LLAMA_VARIANTS = [
    "llama_gqa",
    "llama_mha_tied",
    "llama_bias",
    "llama3_rope",
    "qwen2",
    "llama_9_heads_3_kv",
    "llama_head_dim_64",
    "mistral_window",
    "qwen2_window",
]


def _caches(engine) -> list[torch.Tensor]:
    """Every layer's caches and, for a quantized cache, int8's per-token scales, as bytes
    (torch.equal has no float8 kernel)."""
    held = []
    for a in engine.model.attention_layers():
        held += [a.k_cache.view(torch.uint8).clone(), a.v_cache.view(torch.uint8).clone()]
        if a.k_scale is not None and a.k_scale.numel() > 1:
            held += [a.k_scale.clone(), a.v_scale.clone()]
    return held


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", LLAMA_VARIANTS)
def test_flat_step_gives_the_generic_forwards_bits(
    name, dtype, model_dirs, engine_for, monkeypatch
):
    engine = engine_for(model_dirs(name), num_blocks=64, dtype=dtype)
    _check_flat_against_generic(engine, monkeypatch)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("name", ["llama_9_heads_3_kv", "mistral_window"])
def test_flat_step_over_a_quantized_cache_gives_the_generic_forwards_bits(
    name, kv, model_dirs, engine_for, monkeypatch
):
    """The C++ cache write quantizes as the torch write does (cadence.kv_format): the
    same stored bytes and scales, hence the same attention and hidden states."""
    engine = engine_for(model_dirs(name), num_blocks=64, dtype="bfloat16", kv_cache_dtype=kv)
    _check_flat_against_generic(engine, monkeypatch)


def _check_flat_against_generic(engine, monkeypatch) -> None:
    """Mixed steps, chunks over a cached prefix, then decode-only steps: the flat step's
    hidden states and cache contents are the generic forward's, step by step."""
    assert isinstance(engine.runner, LlamaCpuFlatRunner)
    generic_runner = ModelRunner(engine.model, engine.attention_backend)
    taken: list[int] = []
    flat_step = llama_cpu_flat.forward_step

    def counted(model, input_ids, positions, ctx):
        taken.append(input_ids.shape[0])
        return flat_step(model, input_ids, positions, ctx)

    monkeypatch.setattr(llama_cpu_flat, "forward_step", counted)
    router = MiniRouter(engine, seed=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 16, 30, 17)]
    steps = [  # (joined, continuing) per step
        ([router.join(0, prompts[0]), router.join(1, prompts[1])], []),
        ([router.join(2, prompts[2], num_compute=20)], [0, 1]),  # mixed, first chunk
        ([router.join(3, prompts[3])], [0, 1, (2, 10)]),  # chunk over a cached prefix
        *[([], [0, 1, 2, 3])] * 10,  # decode only: block boundaries, past the window of 8
    ]
    e = engine
    assert e.state is not None and e.kv is not None
    for n, (joined, continuing) in enumerate(steps):
        cont = [router.cont(*c) if isinstance(c, tuple) else router.cont(c) for c in continuing]
        req = shard_pb2.StepRequest(joined=joined, continuing=cont)
        with torch.inference_mode():
            plan = e.apply(req, e.state, e.kv)
            batch = e.state.prepare(plan.rows)
            flat = e.forward(batch)
            assert taken[-1:] == [batch.num_tokens]  # every step takes the flat loop
            after_flat = _caches(e)
            with monkeypatch.context() as m:
                m.setattr(e, "runner", generic_runner)
                generic = e.forward(batch)
            assert torch.equal(flat, generic), f"step {n}"
            same = zip(after_flat, _caches(e), strict=True)
            assert all(torch.equal(a, b) for a, b in same), f"step {n}"
            logits = e.model.compute_logits(flat[batch.sample_rows]).float()
            sampled = logits.argmax(dim=-1)
            e.state.commit(batch, sampled)
        for i, token in zip(batch.sample_rows.tolist(), sampled.tolist(), strict=True):
            router.reqs[batch.ids[i]].tokens.append(token)
    assert len(taken) == len(steps)

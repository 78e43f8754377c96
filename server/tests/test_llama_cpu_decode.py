"""The flat CPU decode step of the Llama family (`cadence.models.llama_cpu_decode`) gives
the generic forward's bits: same hidden states and same KV cache contents, step after
step, in float32 and bfloat16, for every Llama variant (GQA, biases, Qwen2, sliding
windows, llama3 rope, SmolLM2's 9-in-3 heads, head_dim 64 for the vector paths). The
transformers-equivalence tests of test_model.py run through it too, since it is the CPU
default for decode-only steps."""

from __future__ import annotations

import random

import pytest
import torch
from cadence.kernels import cpu
from cadence.models import llama_cpu_decode
from cadence.pb import shard_pb2
from shard_helpers import MiniRouter

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")

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
    return [t.clone() for a in engine.model.attention_layers() for t in (a.k_cache, a.v_cache)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", LLAMA_VARIANTS)
def test_flat_decode_step_gives_the_generic_forwards_bits(
    name, dtype, model_dirs, engine_for, monkeypatch
):
    engine = engine_for(model_dirs(name), num_blocks=64, dtype=dtype)
    taken: list[int] = []
    flat_step = llama_cpu_decode.decode_step

    def counted(model, input_ids, positions, ctx):
        taken.append(input_ids.shape[0])
        return flat_step(model, input_ids, positions, ctx)

    monkeypatch.setattr(llama_cpu_decode, "decode_step", counted)
    router = MiniRouter(engine, seed=1)
    rng = random.Random(0)
    lengths = [5, 16, 17, 30]  # around block boundaries; past the window of 8
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]
    joined = [router.join(i, prompt) for i, prompt in enumerate(prompts)]
    e = engine
    assert e.state is not None and e.kv is not None
    for step in range(12):
        if step == 0:
            req = shard_pb2.StepRequest(joined=joined)
        else:
            req = shard_pb2.StepRequest(continuing=[router.cont(i) for i in range(len(lengths))])
        with torch.inference_mode():
            plan = e.apply(req, e.state, e.kv)
            batch = e.state.prepare(plan.rows)
            calls = len(taken)
            flat = e.forward(batch)
            assert len(taken) == calls + (step > 0)  # decode-only steps take the flat loop
            after_flat = _caches(e)
            with monkeypatch.context() as m:
                m.setattr(llama_cpu_decode, "applies", lambda *args: False)
                generic = e.forward(batch)
            assert torch.equal(flat, generic), f"step {step}"
            assert all(torch.equal(a, b) for a, b in zip(after_flat, _caches(e), strict=True)), (
                f"step {step}"
            )
            logits = e.model.compute_logits(flat[batch.sample_rows]).float()
            sampled = logits.argmax(dim=-1)
            e.state.commit(batch, sampled)
        for i, token in zip(batch.sample_rows.tolist(), sampled.tolist(), strict=True):
            router.reqs[batch.ids[i]].tokens.append(token)
    assert taken == [len(lengths)] * 11

"""Engine.step end to end: greedy generation equals transformers, recompute preemption
continues identically, seeded sampling is independent of the batch around it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cadence.pb import shard_pb2
from cadence.shard.engine import Engine
from cadence.shard.step_checks import StepError
from shard_helpers import MiniRouter
from transformers import PreTrainedModel


def _hf_greedy(hf: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2"])
def test_greedy_generation_through_step_equals_transformers_generate(
    variant, model_dirs, hf_model, engine_for
):
    path = model_dirs(variant)
    hf, engine = hf_model(path), engine_for(path)
    router = MiniRouter(engine)
    prompts = _prompts(4, [5, 16, 23])
    n = 12
    expected = [_hf_greedy(hf, p, n) for p in prompts]
    # requests join at different steps, so prefills and decodes share batches
    router.step(joined=[router.join(0, prompts[0])])
    router.step(joined=[router.join(1, prompts[1])], continuing=[router.cont(0)])
    router.step(joined=[router.join(2, prompts[2])], continuing=[router.cont(0), router.cont(1)])
    while any(len(router.reqs[i].tokens) < len(prompts[i]) + n for i in range(3)):
        live = [i for i in range(3) if len(router.reqs[i].tokens) < len(prompts[i]) + n]
        router.step(continuing=[router.cont(i) for i in live])
    for i in range(3):
        assert router.reqs[i].tokens[len(prompts[i]) :][:n] == expected[i]


def test_recompute_preemption_continues_with_identical_greedy_output(model_dirs, engine_for):
    path = model_dirs("llama_gqa")
    prompt = _prompts(5, [14])[0]

    def run(preempt_at: int | None) -> list[int]:
        router = MiniRouter(engine_for(path))
        router.step(joined=[router.join(0, prompt)])
        for step in range(1, 15):
            if step == preempt_at:
                r = router.reqs[0]
                router.step(removed=[router.remove(0)])
                router.step(joined=[router.join(0, r.tokens, prompt_len=len(prompt))])
            else:
                router.step(continuing=[router.cont(0)])
        return router.reqs[0].tokens

    assert run(None) == run(6)


def _sample_alone_and_in_batch(
    path: Path,
    engine_for: Callable[..., Engine],
    sampling: shard_pb2.SamplingParams,
    steps: int = 6,
) -> tuple[list[int], list[int]]:
    prompt = _prompts(6, [11])[0]
    others = _prompts(7, [4, 19, 30])

    alone = MiniRouter(engine_for(path))
    alone.step(joined=[alone.join(0, prompt, sampling=sampling)])
    for _ in range(steps):
        alone.step(continuing=[alone.cont(0)])

    crowded = MiniRouter(engine_for(path), seed=9)
    noisy = shard_pb2.SamplingParams(do_sample=True, temperature=1.3, seed=99, top_k=20)
    crowded.step(joined=[crowded.join(i + 1, p, sampling=noisy) for i, p in enumerate(others)])
    crowded.step(
        joined=[crowded.join(0, prompt, sampling=sampling)],
        continuing=[crowded.cont(i) for i in (3, 1)],
    )
    for s in range(steps):
        rest = [crowded.cont(i) for i in (1, 2, 3) if s % 2 == i % 2]
        crowded.step(continuing=[crowded.cont(0), *rest])
    return alone.reqs[0].tokens, crowded.reqs[0].tokens


def test_same_seed_samples_identically_alone_and_in_a_batch(model_dirs, engine_for):
    path = model_dirs("llama_gqa")
    params = shard_pb2.SamplingParams(
        do_sample=True, temperature=1.5, top_p=0.95, top_k=100, seed=12345
    )
    alone, crowded = _sample_alone_and_in_batch(path, engine_for, params)
    assert alone == crowded
    other = shard_pb2.SamplingParams(
        do_sample=True, temperature=1.5, top_p=0.95, top_k=100, seed=54321
    )
    different, _ = _sample_alone_and_in_batch(path, engine_for, other)
    assert different != alone


def test_top_k_one_sampling_equals_greedy(model_dirs, engine_for):
    path = model_dirs("llama_gqa")
    greedy, _ = _sample_alone_and_in_batch(path, engine_for, shard_pb2.SamplingParams())
    top1, _ = _sample_alone_and_in_batch(
        path, engine_for, shard_pb2.SamplingParams(do_sample=True, temperature=2.0, top_k=1)
    )
    assert top1 == greedy


def test_generations_report_logprobs_and_top_tokens(model_dirs, hf_model, engine_for):
    path = model_dirs("llama_gqa")
    router = MiniRouter(engine_for(path))
    prompt = _prompts(8, [9])[0]
    resp = router.step(joined=[router.join(0, prompt, top_n=3)])
    (gen,) = resp.generations
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    assert gen.token_ids[0] == int(ref.argmax())
    assert gen.logprobs[0] == pytest.approx(float(ref.max()), abs=1e-4)
    top = ref.topk(3)
    assert list(gen.top_tokens[0].ids) == top.indices.tolist()
    assert list(gen.top_tokens[0].logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert resp.computed_tokens == len(prompt) and resp.forward_ns > 0


def test_mid_prefill_chunks_produce_no_generation(model_dirs, engine_for):
    router = MiniRouter(engine_for(model_dirs("llama_gqa")))
    resp = router.step(joined=[router.join(0, list(range(3, 40)), num_compute=20)])
    assert not resp.generations and resp.computed_tokens == 20
    resp = router.step(continuing=[router.cont(0)])
    assert [g.id for g in resp.generations] == [0] and resp.computed_tokens == 17


def test_a_bad_step_is_rejected_whole_and_the_state_is_untouched(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"))
    router = MiniRouter(engine)
    router.step(joined=[router.join(0, [5, 6, 7])])
    bad = shard_pb2.NewRequest(
        id=1, token_ids=[5, 6], prompt_len=2, num_compute=2, block_table=[10_000]
    )
    with pytest.raises(StepError, match="block 10000"):
        engine.step(shard_pb2.StepRequest(joined=[bad], continuing=[router.cont(0)]))
    router.reqs[0].computed -= 1  # the rejected step computed nothing
    with pytest.raises(StepError, match="not held"):
        engine.step(shard_pb2.StepRequest(continuing=[shard_pb2.ContinuingRequest(id=42)]))
    resp = router.step(continuing=[router.cont(0)])
    assert [g.id for g in resp.generations] == [0]


def test_copy_on_write_and_swap_round_trip_preserve_blocks(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"))
    kv = engine.kv
    kv.blocks[:, :, 3].normal_()
    original = kv.blocks[:, :, 3].clone()
    kv.copy_blocks([3], [7])
    assert torch.equal(kv.blocks[:, :, 7], original)
    kv.swap_out([7], [5])
    kv.blocks[:, :, 7].zero_()
    kv.swap_in([5], [9])
    assert torch.equal(kv.blocks[:, :, 9], original)


def test_a_uint64_seed_above_two_to_the_63_is_accepted(model_dirs, engine_for):
    router = MiniRouter(engine_for(model_dirs("llama_gqa")))
    params = shard_pb2.SamplingParams(do_sample=True, temperature=1.0, seed=(1 << 64) - 1)
    resp = router.step(joined=[router.join(0, [5, 6, 7], sampling=params)])
    assert len(resp.generations) == 1

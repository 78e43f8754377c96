"""The per-request extras the HTTP surface needs from a shard: OpenAI's logit_bias and
prompt logprobs (TGI's decoder_input_details, OpenAI's echo + logprobs), checked against
transformers running the same weights."""

from __future__ import annotations

import torch
from cadence.pb import shard_pb2
from shard_helpers import MiniRouter, hf_logits


def _prompt(n: int, seed: int = 7) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logit_bias_is_added_to_the_logits_before_everything_else(model_dirs, hf_model, engine_for):
    path = model_dirs("llama_gqa")
    hf = hf_model(path)
    prompt = _prompt(9)
    ref = hf_logits(hf, prompt)[-1]
    greedy = int(ref.argmax())
    forced = int(ref.argmin())
    bias = {greedy: -100.0, forced: 100.0, 5: 0.5}
    router = MiniRouter(engine_for(path))
    sampling = shard_pb2.SamplingParams(logit_bias=bias)
    resp = router.step(joined=[router.join(0, prompt, sampling=sampling, top_n=2)])
    (g,) = resp.generations
    assert g.token_ids[0] == forced
    biased = ref.clone()
    for token, value in bias.items():
        biased[token] += value
    expected = biased.log_softmax(-1)
    torch.testing.assert_close(g.logprobs[0], float(expected[forced]), atol=1e-4, rtol=1e-4)
    assert list(g.top_tokens[0].ids) == expected.topk(2).indices.tolist()


def test_a_banned_token_is_not_picked_and_other_requests_keep_theirs(engine_for, model_dirs):
    path = model_dirs("llama_gqa")
    router = MiniRouter(engine_for(path))
    prompt = _prompt(6, seed=3)
    plain = router.step(joined=[router.join(0, prompt, top_n=1)]).generations[0]
    banned = plain.token_ids[0]
    sampling = shard_pb2.SamplingParams(logit_bias={banned: -100.0})
    biased = router.step(
        joined=[router.join(1, prompt, sampling=sampling)], continuing=[router.cont(0)]
    ).generations
    by_id = {g.id: g for g in biased}
    assert by_id[1].token_ids[0] != banned
    # the bias belongs to its request: the same prompt without it still picks the token
    plain_again = router.step(joined=[router.join(2, prompt)]).generations[0]
    assert plain_again.token_ids[0] == banned


def test_prompt_logprobs_equal_transformers_across_chunked_prefill(
    model_dirs, hf_model, engine_for
):
    path = model_dirs("llama_gqa")
    hf = hf_model(path)
    prompt = _prompt(21, seed=11)
    ref = hf_logits(hf, prompt).log_softmax(-1)
    expected = ref[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    router = MiniRouter(engine_for(path))
    new = router.join(0, prompt, num_compute=8, top_n=3)
    new.prompt_logprobs = True
    assert not router.step(joined=[new]).generations  # mid-prefill: nothing sampled
    assert not router.step(continuing=[router.cont(0, 8)]).generations
    (g,) = router.step(continuing=[router.cont(0)]).generations
    assert len(g.prompt_logprobs) == len(prompt) - 1
    torch.testing.assert_close(
        torch.tensor(list(g.prompt_logprobs)), expected, atol=1e-4, rtol=1e-4
    )
    assert [list(t.ids) for t in g.prompt_top_tokens] == ref[:-1].topk(3).indices.tolist()
    # sent once: the next decode carries none
    (g2,) = router.step(continuing=[router.cont(0)]).generations
    assert not g2.prompt_logprobs and not g2.prompt_top_tokens

"""Structured outputs on the shard: a constrained request's allowed-token mask
(`StepRequest.allowed`, applied before every other sampling step) and a continuing
request's forced tokens (`ContinuingRequest.forced_tokens`, appended as generated tokens).

Every expected value comes from a reference: the same engine without the feature (an
unconstrained request's full distribution, through `top_n_tokens`; a fresh request whose
prompt holds the forced tokens, marked as generated), or transformers on the same weights.
The masks are checked through both model runners -- the flat C++ step with the C++ greedy
kernel, the generic forward beside the same kernels, and torch alone (torch attention and
the sampler's own argmax) -- in float32 and bfloat16, and through 2 tensor-parallel ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cadence import sampling
from cadence.pb import shard_pb2
from cadence.runners import LlamaCpuFlatRunner, ModelRunner
from cadence.sampling import mask_disallowed
from cadence.shard.engine import Engine
from cadence.shard.step_checks import StepError
from cadence.shard.steps import StepSession
from shard_helpers import MiniRouter, allowed_tokens, hf_logits, mask_of_words, words_of
from tp_worker import constrained_generations, run_group

# the flat C++ step (+ C++ greedy), the generic forward with the same kernels, torch alone
RUNNERS = ["flat", "generic", "torch"]
DTYPES = ["float32", "bfloat16"]
TOL = 1e-4


def _engine(
    engine_for: Callable[..., Engine], path: Path, runner: str, dtype: str = "float32"
) -> Engine:
    if runner == "torch":  # torch attention and layers, the sampler's own argmax
        engine = engine_for(path, dtype=dtype, cpu_kernels=False)
        assert type(engine.runner) is ModelRunner and engine.ops.greedy is None
        return engine
    from cadence.kernels import cpu

    if not cpu.available():
        pytest.skip(f"no CPU kernels: {cpu.unavailable_reason()}")
    engine = engine_for(path, dtype=dtype)
    assert isinstance(engine.runner, LlamaCpuFlatRunner) and engine.ops.greedy is not None
    if runner == "generic":
        engine.runner = ModelRunner(engine.model, engine.attention_backend)
    return engine


def _prompt(n: int, seed: int = 7) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _vocab(engine: Engine) -> int:
    return engine.model.config.vocab_size


def _unconstrained(router: MiniRouter, tokens: list[int], prompt_len: int | None = None):
    """The engine's own next-token log-probabilities [vocab] after `tokens`, unconstrained
    (a greedy request alone in its step, every token as a top token); the request is
    removed again."""
    assert router.engine is not None
    vocab = _vocab(router.engine)
    rid = 1000 + len(router.reqs)
    new = router.join(rid, tokens, prompt_len=prompt_len, top_n=vocab)
    (g,) = router.step(joined=[new]).generations
    router.step(removed=[router.remove(rid)])
    logprobs = torch.empty(vocab)
    logprobs[torch.tensor(list(g.top_tokens[0].ids))] = torch.tensor(list(g.top_tokens[0].logprobs))
    assert int(logprobs.argmax()) == g.token_ids[0]
    return logprobs


def _subset(ref: torch.Tensor, size: int, seed: int) -> list[int]:
    """`size` random tokens, none the unconstrained argmax."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(ref.shape[0], generator=g).tolist()
    return sorted(t for t in order if t != int(ref.argmax()))[:size]


def _masked_logprobs(ref: torch.Tensor, allowed: list[int]) -> dict[int, float]:
    """log-softmax over `allowed` of a distribution's logits (or logprobs: the same)."""
    values = ref[torch.tensor(allowed)].log_softmax(0).tolist()
    return dict(zip(allowed, values, strict=True))


# -- masks -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masking_reads_bit_t_of_word_t_over_32_least_significant_first(dtype):
    vocab = 100  # 4 words, the last one partly past the vocabulary
    g = torch.Generator().manual_seed(0)
    sets = [
        [31, 63, 95],  # the sign bit of each full word
        [0, 32, 64, 96, 99],
        torch.randperm(vocab, generator=g)[:40].tolist(),
        list(range(vocab)),
    ]
    masks = [allowed_tokens(0, s, vocab) for s in sets]
    words = torch.tensor([words_of(m) for m in masks], dtype=torch.int64).to(torch.int32)
    logits = torch.randn(len(sets) + 1, vocab, generator=g).to(dtype)
    rows = torch.arange(1, len(sets) + 1)  # row 0 has no mask and stays as it was
    got = mask_disallowed(logits, rows, words)
    assert torch.equal(got[0], logits[0])
    for i, s in enumerate(sets, start=1):
        assert torch.isfinite(got[i]).nonzero().squeeze(1).tolist() == sorted(s)
        assert torch.equal(got[i, sorted(s)], logits[i, sorted(s)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_one_token_mask_gives_that_token_with_logprob_zero(runner, dtype, model_dirs, engine_for):
    engine = _engine(engine_for, model_dirs("llama_gqa"), runner, dtype)
    router = MiniRouter(engine)
    vocab = _vocab(engine)
    prompt = _prompt(9)
    ref = _unconstrained(router, prompt)
    only = int(ref.argmin())
    assert only != int(ref.argmax())
    # top_k 3 would drop the token if the mask came after it: no token would be left
    sampled = shard_pb2.SamplingParams(do_sample=True, temperature=0.7, top_k=3, seed=5)

    def check(g: shard_pb2.Generation) -> None:
        assert g.token_ids[0] == only
        assert g.logprobs[0] == pytest.approx(0.0, abs=1e-6)

    # greedy alone: the greedy kernel's path (flat, generic); sampled alone
    (g,) = router.step(
        joined=[router.join(0, prompt)], allowed=[allowed_tokens(0, [only], vocab)]
    ).generations
    check(g)
    (g,) = router.step(
        joined=[router.join(1, prompt, sampling=sampled)],
        allowed=[allowed_tokens(1, [only], vocab)],
    ).generations
    check(g)
    # a mixed step: an unconstrained decode row first, then a constrained greedy prefill
    # and an unconstrained one; the mask is its row's only
    resp = router.step(
        joined=[router.join(2, prompt), router.join(3, prompt)],
        continuing=[router.cont(0)],
        allowed=[allowed_tokens(2, [only], vocab)],
    )
    by_id = {g.id: g for g in resp.generations}
    assert sorted(by_id) == [0, 2, 3]
    check(by_id[2])
    assert by_id[3].token_ids[0] == int(ref.argmax())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_greedy_under_a_mask_is_the_argmax_within_the_set(runner, dtype, model_dirs, engine_for):
    engine = _engine(engine_for, model_dirs("llama_gqa"), runner, dtype)
    router = MiniRouter(engine)
    vocab = _vocab(engine)
    prompt = _prompt(11, seed=3)
    ref = _unconstrained(router, prompt)
    allowed = _subset(ref, 12, seed=1)
    expected = _masked_logprobs(ref, allowed)
    best = max(allowed, key=lambda t: ref[t])
    # alone without top tokens (the greedy kernel where there is one), then with 3
    (g,) = router.step(
        joined=[router.join(0, prompt)], allowed=[allowed_tokens(0, allowed, vocab)]
    ).generations
    assert g.token_ids[0] == best
    assert g.logprobs[0] == pytest.approx(expected[best], abs=TOL)
    (g,) = router.step(
        joined=[router.join(1, prompt, top_n=3)], allowed=[allowed_tokens(1, allowed, vocab)]
    ).generations
    top = sorted(allowed, key=lambda t: -ref[t])[:3]
    assert g.token_ids[0] == best
    assert list(g.top_tokens[0].ids) == top
    assert list(g.top_tokens[0].logprobs) == pytest.approx([expected[t] for t in top], abs=TOL)


@pytest.mark.parametrize("runner", RUNNERS)
def test_sampled_tokens_stay_in_the_set_with_its_log_softmax(runner, model_dirs, engine_for):
    engine = _engine(engine_for, model_dirs("llama_gqa"), runner)
    router = MiniRouter(engine)
    vocab = _vocab(engine)
    prompt = _prompt(8, seed=4)
    ref = _unconstrained(router, prompt)
    allowed = _subset(ref, 10, seed=2)
    temperature, top_k = 1.5, 4
    by_temperature = _masked_logprobs(ref / temperature, allowed)
    best_k = sorted(allowed, key=lambda t: -ref[t])[:top_k]
    by_top_k = _masked_logprobs(ref / temperature, best_k)
    n = 32  # seeds, in one step: half with top_k, which keeps the 4 best of the set
    params = [
        shard_pb2.SamplingParams(
            do_sample=True, temperature=temperature, seed=seed, top_k=top_k if seed % 2 else 0
        )
        for seed in range(n)
    ]
    resp = router.step(
        joined=[router.join(i, prompt, sampling=p) for i, p in enumerate(params)],
        allowed=[allowed_tokens(i, allowed, vocab) for i in range(n)],
    )
    assert len(resp.generations) == n
    drawn: set[int] = set()
    for g in resp.generations:
        expected = by_top_k if g.id % 2 else by_temperature
        token = g.token_ids[0]
        assert token in expected, (g.id, token)
        assert g.logprobs[0] == pytest.approx(expected[token], abs=TOL)
        drawn.add(token)
    assert len(drawn) > 2  # the draws spread over the set


@pytest.mark.parametrize("runner", ["flat", "torch"])
def test_logit_bias_and_penalties_apply_after_the_mask(runner, model_dirs, engine_for):
    engine = _engine(engine_for, model_dirs("llama_gqa"), runner)
    router = MiniRouter(engine)
    vocab = _vocab(engine)
    prompt, generated = _prompt(7, seed=5), _prompt(5, seed=6)
    tokens = prompt + generated
    ref = _unconstrained(router, tokens, prompt_len=len(prompt))
    allowed = _subset(ref, 10, seed=3)
    banned = int(ref.argmax())  # disallowed: a +100 bias must not bring it back
    lifted = min(allowed, key=lambda t: ref[t])  # the set's worst, +8
    bias = {banned: 100.0, lifted: 8.0}
    biased = ref.clone()
    for t, v in bias.items():
        biased[t] += v
    expected = _masked_logprobs(biased, allowed)
    best = max(allowed, key=lambda t: biased[t])
    assert best != banned
    for greedy, rid in ((True, 0), (False, 1)):
        params = shard_pb2.SamplingParams(logit_bias=bias, seed=rid)
        if not greedy:
            params.do_sample, params.temperature = True, 1.0
        (g,) = router.step(
            joined=[router.join(rid, tokens, prompt_len=len(prompt), sampling=params)],
            allowed=[allowed_tokens(rid, allowed, vocab)],
        ).generations
        assert g.token_ids[0] in allowed
        assert g.logprobs[0] == pytest.approx(expected[g.token_ids[0]], abs=TOL)
        if greedy:
            assert g.token_ids[0] == best
    # negative frequency and presence penalties lift the generated tokens (+20 per
    # occurrence, +5 once present): the allowed ones, and a disallowed one stays out
    kept_out = generated[-1]
    assert kept_out not in generated[:2]
    allowed_penalized = sorted((set(allowed) | set(generated[:2])) - {kept_out})
    freq, presence = -20.0, -5.0
    penalized = ref.clone()
    for t in set(generated):
        penalized[t] -= freq * generated.count(t) + presence
    expected = _masked_logprobs(penalized, allowed_penalized)
    best = max(allowed_penalized, key=lambda t: penalized[t])
    assert best in generated[:2]  # the penalty decides
    params = shard_pb2.SamplingParams(frequency_penalty=freq, presence_penalty=presence)
    (g,) = router.step(
        joined=[router.join(2, tokens, prompt_len=len(prompt), sampling=params)],
        allowed=[allowed_tokens(2, allowed_penalized, vocab)],
    ).generations
    assert g.token_ids[0] == best
    assert g.logprobs[0] == pytest.approx(expected[best], abs=TOL)


def test_a_mask_shorter_than_the_logits_disallows_the_tail(model_dirs, engine_for):
    engine = _engine(engine_for, model_dirs("llama_gqa"), "flat")
    router = MiniRouter(engine)
    vocab = _vocab(engine)
    prompt = _prompt(9, seed=8)
    ref = _unconstrained(router, prompt)
    # whole words of ones up to the argmax's word: every token from there on is disallowed
    words = int(ref.argmax()) // 32
    assert words > 0
    head = list(range(32 * words))
    mask = allowed_tokens(0, head, vocab, words=words)
    assert words_of(mask) == [0xFFFFFFFF] * words
    (g,) = router.step(joined=[router.join(0, prompt)], allowed=[mask]).generations
    assert g.token_ids[0] == max(head, key=lambda t: ref[t])
    assert g.logprobs[0] == pytest.approx(_masked_logprobs(ref, head)[g.token_ids[0]], abs=TOL)
    # the last token of the vocabulary: the sign bit of the last word
    (g,) = router.step(
        joined=[router.join(1, prompt)], allowed=[allowed_tokens(1, [vocab - 1], vocab)]
    ).generations
    assert g.token_ids[0] == vocab - 1 and g.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_bits_past_an_odd_vocabulary_allow_nothing(model_dirs, engine_for):
    engine = _engine(engine_for, model_dirs("llama_kv1_odd_vocab"), "flat")
    router = MiniRouter(engine)
    vocab = _vocab(engine)
    assert vocab == 257  # 9 words: the last one holds token 256 and 31 bits past the logits
    prompt = _prompt(6, seed=9)
    last_word_only = [0] * 8
    (g,) = router.step(
        joined=[router.join(0, prompt)],
        allowed=[mask_of_words(0, [*last_word_only, 0xFFFFFFFF])],
    ).generations
    assert g.token_ids[0] == 256 and g.logprobs[0] == pytest.approx(0.0, abs=1e-6)
    past_only = mask_of_words(1, [*last_word_only, 0xFFFFFFFE])
    with pytest.raises(StepError, match="allowed: request 1 allows no token"):
        engine.step(shard_pb2.StepRequest(joined=[router.join(1, prompt)], allowed=[past_only]))


def _decode(rid: int, forced: list[int] | None = None) -> shard_pb2.ContinuingRequest:
    """The decode of a request's last sampled token (+ forced tokens), no new block."""
    forced = forced or []
    return shard_pb2.ContinuingRequest(id=rid, num_compute=1 + len(forced), forced_tokens=forced)


def test_a_bad_mask_or_forced_tokens_reject_the_step_and_the_next_step_runs(model_dirs, engine_for):
    path = model_dirs("llama_gqa")
    engine = _engine(engine_for, path, "flat")
    router = MiniRouter(engine)
    vocab = _vocab(engine)
    prompt = _prompt(5, seed=10)
    router.step(joined=[router.join(0, prompt)])  # samples: 6 tokens, 5 computed (1 block)
    ones = allowed_tokens(0, range(vocab), vocab)
    mid_prefill = router.join(1, _prompt(20, seed=11), num_compute=8)
    bad = [  # (step, what the error names); each would append a forced token to request 0
        (dict(allowed=[allowed_tokens(42, [5], vocab)]), "allowed: request 42 is not held"),
        (
            dict(allowed=[mask_of_words(0, [0xFFFFFFFF] * 9)]),
            "allowed: request 0 has 9 words, more than the 8 of its 256-token logits",
        ),
        (dict(allowed=[mask_of_words(0, [0] * 8)]), "request 0 allows no"),
        (
            dict(allowed=[shard_pb2.AllowedTokens(id=0, words=b"\xff" * 5)]),
            "allowed: request 0's words are 5 bytes, not a multiple of 4",
        ),
        (dict(allowed=[ones, ones]), "allowed: request 0 has two masks"),
        (
            dict(joined=[mid_prefill], allowed=[ones, allowed_tokens(1, [5], vocab)]),
            "allowed: request 1 does not sample this step",
        ),
    ]
    for diff, error in bad:
        with pytest.raises(StepError, match=error):
            engine.step(shard_pb2.StepRequest(continuing=[_decode(0, [9])], **diff))
    # held but not scheduled this step: it samples nothing either
    with pytest.raises(StepError, match="allowed: request 0 does not sample this step"):
        engine.step(shard_pb2.StepRequest(allowed=[ones]))
    with pytest.raises(StepError, match="forced_tokens token id 256 >= vocab"):
        engine.step(shard_pb2.StepRequest(continuing=[_decode(0, [256])]))
    too_far = shard_pb2.ContinuingRequest(id=0, num_compute=3, forced_tokens=[9])
    with pytest.raises(StepError, match="exceeds its known tokens"):
        engine.step(shard_pb2.StepRequest(continuing=[too_far]))
    # none of them appended a token or computed anything: the decode goes on as in an
    # engine that never saw them
    after = list(router.step(continuing=[router.cont(0)]).generations)
    clean = MiniRouter(_engine(engine_for, path, "flat"))
    clean.step(joined=[clean.join(0, prompt)])
    assert after == list(clean.step(continuing=[clean.cont(0)]).generations)


def test_a_rejected_mask_is_the_steps_answer_on_the_stream_and_the_next_step_runs(
    model_dirs, engine_for
):
    engine = _engine(engine_for, model_dirs("llama_gqa"), "flat")
    router = MiniRouter(engine)
    prompt = _prompt(5, seed=12)
    ok = router.join(0, prompt)
    unknown = allowed_tokens(42, [5], _vocab(engine))

    async def session() -> list[shard_pb2.StepAnswer]:
        with ThreadPoolExecutor(1) as executor:
            steps = StepSession(engine, executor)
            sent = [
                steps.submit(shard_pb2.StepRequest(step_id=7, joined=[ok], allowed=[unknown])),
                steps.submit(shard_pb2.StepRequest(step_id=8, joined=[ok])),
            ]
            return [await a for a in sent]

    rejected, ran = asyncio.run(session())
    assert rejected.error == "step 7 rejected: allowed: request 42 is not held"
    assert [g.id for g in ran.response.generations] == [0]


def test_a_step_without_masks_unpacks_nothing(model_dirs, engine_for, monkeypatch):
    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("a step without masks unpacked one")

    engine = _engine(engine_for, model_dirs("llama_gqa"), "flat")  # (warmup masks)
    monkeypatch.setattr(sampling, "mask_disallowed", refuse)
    router = MiniRouter(engine)
    (g,) = router.step(joined=[router.join(0, _prompt(5, seed=13))]).generations
    (g,) = router.step(continuing=[router.cont(0, forced=[7, 8])]).generations
    assert g.id == 0


# -- forced tokens -----------------------------------------------------------------------

SAMPLINGS = {
    "greedy": shard_pb2.SamplingParams(),
    "seeded_with_penalties": shard_pb2.SamplingParams(
        do_sample=True,
        temperature=0.9,
        top_p=0.95,
        seed=77,
        repetition_penalty=1.3,
        frequency_penalty=0.7,
        presence_penalty=0.4,
    ),
}


@pytest.mark.parametrize("kind", list(SAMPLINGS))
@pytest.mark.parametrize("runner", RUNNERS)
def test_forced_tokens_continue_as_if_they_had_been_generated(
    runner, kind, model_dirs, hf_model, engine_for
):
    path = model_dirs("llama_gqa")
    engine = _engine(engine_for, path, runner)
    router = MiniRouter(engine)
    params = SAMPLINGS[kind]
    prompt = _prompt(13, seed=14)
    forced = [prompt[2], 77]
    # 0 computes its sampled token and both forced ones at once; 1 stops inside them
    first = router.step(
        joined=[router.join(i, prompt, sampling=params, top_n=4) for i in (0, 1)]
    ).generations
    s = first[0].token_ids[0]
    assert first[1].token_ids[0] == s
    resp = router.step(
        continuing=[router.cont(0, forced=forced), router.cont(1, num_compute=2, forced=forced)]
    )
    assert [g.id for g in resp.generations] == [0] and resp.computed_tokens == 5
    (whole,) = resp.generations
    (chunked,) = router.step(continuing=[router.cont(1)]).generations
    assert chunked.id == 1
    # the reference: a fresh request whose prompt holds them, marked as generated
    tokens = prompt + [s, *forced]
    (fresh,) = router.step(
        joined=[router.join(2, tokens, prompt_len=len(prompt), sampling=params, top_n=4)]
    ).generations
    for g in (whole, chunked):
        assert g.token_ids[0] == fresh.token_ids[0]
        assert g.logprobs[0] == pytest.approx(fresh.logprobs[0], abs=TOL)
        assert list(g.top_tokens[0].ids) == list(fresh.top_tokens[0].ids)
        assert list(g.top_tokens[0].logprobs) == pytest.approx(
            list(fresh.top_tokens[0].logprobs), abs=TOL
        )
    if kind == "greedy":  # and transformers on the whole sequence
        ref = hf_logits(hf_model(path), tokens)[-1].log_softmax(-1)
        assert whole.token_ids[0] == int(ref.argmax())
        assert whole.logprobs[0] == pytest.approx(float(ref.max()), abs=TOL)
    # the next decode agrees too (the forced tokens' KV is where it belongs)
    after = router.step(continuing=[router.cont(i) for i in (0, 1, 2)]).generations
    assert len({g.token_ids[0] for g in after}) == 1
    assert [g.logprobs[0] for g in after] == pytest.approx([after[0].logprobs[0]] * 3, abs=TOL)


def test_frequency_and_presence_penalties_count_forced_tokens(model_dirs, hf_model, engine_for):
    path = model_dirs("llama_gqa")
    engine = _engine(engine_for, path, "flat")
    router = MiniRouter(engine)
    prompt = _prompt(10, seed=15)
    x = prompt[0]
    bias, freq, presence = 30.0, 12.0, 3.0
    params = shard_pb2.SamplingParams(
        logit_bias={x: bias}, frequency_penalty=freq, presence_penalty=presence
    )
    (g,) = router.step(joined=[router.join(0, prompt, sampling=params)]).generations
    s = g.token_ids[0]
    (g,) = router.step(continuing=[router.cont(0, forced=[x, x])]).generations
    raw = hf_logits(hf_model(path), prompt + [s, x, x])[-1]
    raw[x] += bias

    def penalized(generated: list[int]) -> torch.Tensor:
        out = raw.clone()
        for t in set(generated):
            out[t] -= freq * generated.count(t) + presence
        return out

    expected = penalized([s, x, x])
    assert g.token_ids[0] == int(expected.argmax())
    assert g.logprobs[0] == pytest.approx(float(expected.log_softmax(-1).max()), abs=TOL)
    # were the forced tokens not counted, the bias would win
    assert int(expected.argmax()) != x and int(penalized([s]).argmax()) == x


# -- tensor parallelism -------------------------------------------------------------------

TP_MODELS = ["llama_gqa", "llama_kv1_odd_vocab"]


def test_two_ranks_sample_what_one_rank_samples_under_masks_and_forced_tokens(
    model_dirs, engine_for, tmp_path
):
    dirs = [str(model_dirs(name)) for name in TP_MODELS]
    ranks = run_group(2, dirs, tmp_path, "float32", script="constrained")
    for name in TP_MODELS:
        alone = constrained_generations(engine_for(model_dirs(name)))
        assert [rid for rid, _, _ in alone] == [1, 1, 2]  # (step 2: the short chunk first)
        for i, (rid, token, _) in enumerate(alone):  # the masks of tp_worker's script
            assert token % (3 if i == 0 else 5 if rid == 1 else 7) == 1
        for rank, results in enumerate(ranks):
            got = results[name]["constrained"]
            assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in alone], (name, rank)
            assert [lp for _, _, lp in got] == pytest.approx([lp for _, _, lp in alone], abs=TOL)

"""Speculative steps through Engine.step: proposals verified by sample and match give
token for token, logprob for logprob, what decoding one token at a time gives; the state
keeps the accepted tokens and cuts the block table after a partial acceptance; malformed
proposals reject the step; synthetic acceptance runs at its set rate; a draft model's
proposals are verified the same way in greedy rows and rejection-sampled in sampling rows
(a draft that is the target itself: always accepted, the target's tokens).

Every expected value comes from the same engine without speculation (one decode per
token) on the same tiny float32 model."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from cadence.pb import shard_pb2
from cadence.sampling import DO_SAMPLE, SamplingBatch, draw, processed_logprobs, uniform_noise
from cadence.shard.engine import Engine
from cadence.shard.state import BatchState
from cadence.shard.step_checks import StepError
from cadence.speculative.verify import select_rows
from shard_helpers import MiniRouter, allowed_tokens

N = 14  # tokens generated per request
K = 4  # most proposals per step
TOL = 2e-4
GREEDY = shard_pb2.SamplingParams()
SAMPLED = shard_pb2.SamplingParams(
    do_sample=True,
    temperature=0.9,
    top_k=60,
    top_p=0.95,
    repetition_penalty=1.2,
    frequency_penalty=0.3,
    seed=2024,
)
PROMPTS = {0: [5, 9, 33, 81, 7, 12, 200, 45, 3, 77, 61, 18, 90], 1: [44, 2, 19, 250, 8, 130, 6]}
SAMPLINGS = {0: GREEDY, 1: SAMPLED}


@dataclass
class Answer:
    """What a request was answered, token by token."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)  # per step
    accepted: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)  # the tokens of each answer

    def add(self, g: shard_pb2.Generation) -> None:
        self.steps.append(list(g.token_ids))
        self.tokens += g.token_ids
        self.logprobs += g.logprobs
        self.top += [(list(t.ids), list(t.logprobs)) for t in g.top_tokens]
        self.proposed.append(g.num_proposed)
        self.accepted.append(g.num_accepted)


def speculate(router: MiniRouter, rid: int, proposals: list[int]) -> shard_pb2.ContinuingRequest:
    """The decode of request `rid` with proposals (none: a plain decode)."""
    if not proposals:
        return router.cont(rid)
    r = router.reqs[rid]
    new = router._blocks_for(r, r.computed + 1 + len(proposals))
    return shard_pb2.ContinuingRequest(
        id=rid, num_compute=1 + len(proposals), new_blocks=new, proposed_tokens=proposals
    )


def settle(router: MiniRouter, resp: shard_pb2.StepResponse, before: dict[int, int]) -> None:
    """The router's side of a verified answer: computed advances by 1 + accepted and the
    blocks past the computed tokens return to the pool."""
    for g in resp.generations:
        if g.num_proposed:
            r = router.reqs[g.id]
            r.computed = before[g.id] + 1 + g.num_accepted
            keep = -(-r.computed // router.bs)
            router.free += r.blocks[keep:]
            del r.blocks[keep:]


Proposer = Callable[[int, list[int]], list[int]]


def generate(
    engine: Engine, proposer: Proposer | None, samplings: dict = SAMPLINGS
) -> dict[int, Answer]:
    """Both requests generate N tokens (top 3 alternatives each); from the second token on
    each decode step carries `proposer(rid, generated so far)` (none: no speculation)."""
    router = MiniRouter(engine)
    answers = {rid: Answer() for rid in PROMPTS}
    joined = [router.join(r, p, sampling=samplings[r], top_n=3) for r, p in PROMPTS.items()]
    for g in router.step(joined=joined).generations:
        answers[g.id].add(g)
    while live := [r for r in PROMPTS if len(answers[r].tokens) < N]:
        before = {r: router.reqs[r].computed for r in live}
        proposals = {r: proposer(r, answers[r].tokens) if proposer else [] for r in live}
        resp = router.step(continuing=[speculate(router, r, proposals[r]) for r in live])
        settle(router, resp, before)
        for g in resp.generations:
            assert list(g.token_ids[: g.num_accepted]) == proposals[g.id][: g.num_accepted]
            answers[g.id].add(g)
    return answers


@pytest.fixture(scope="module")
def engines(model_dirs, engine_for) -> Callable[[str], Engine]:
    """Fresh engines on the tiny llama: "flat" (the C++ kernels, greedy included) or
    "torch" (torch alone, the sampler's own argmax)."""
    make_engine = engine_for
    path = model_dirs("llama_gqa")

    def make(runner: str, **config) -> Engine:
        return make_engine(path, num_blocks=96, cpu_kernels=runner == "flat", **config)

    return make


@pytest.fixture(scope="module")
def reference(engines) -> dict[int, Answer]:
    return generate(engines("torch"), None)


def _room(generated: list[int]) -> int:
    """Most proposals that keep the request within N tokens (the router's cap)."""
    return max(0, min(K, N - len(generated) - 1))


@pytest.mark.parametrize("runner", ["flat", "torch"])
@pytest.mark.parametrize("kind", ["true", "random", "right_then_wrong"])
def test_proposals_give_the_tokens_and_logprobs_of_decoding_one_at_a_time(
    kind, runner, engines, reference
):
    rng = torch.Generator().manual_seed(3)

    def propose(rid: int, generated: list[int]) -> list[int]:
        truth = reference[rid].tokens[len(generated) : len(generated) + _room(generated)]
        if kind == "true":
            return truth
        wrong = [(t + 1 + int(torch.randint(0, 250, (1,), generator=rng))) % 256 for t in truth]
        return wrong if kind == "random" else truth[:2] + wrong[2:]

    got = generate(engines(runner), propose)
    for rid, ref in reference.items():
        ans = got[rid]
        assert ans.tokens == ref.tokens, (rid, kind)
        assert ans.logprobs == pytest.approx(ref.logprobs, abs=TOL)
        assert [ids for ids, _ in ans.top] == [ids for ids, _ in ref.top]
        for (_, lps), (_, ref_lps) in zip(ans.top, ref.top, strict=True):
            assert lps == pytest.approx(ref_lps, abs=TOL)
        steps = [(k, a) for k, a in zip(ans.proposed, ans.accepted, strict=True) if k]
        assert steps, "no step carried proposals"
        expected = {"true": [k for k, _ in steps], "random": [0] * len(steps)}
        expected["right_then_wrong"] = [min(2, k) for k, _ in steps]
        assert [a for _, a in steps] == expected[kind]
        # the steps answered 1 + accepted tokens each
        assert len(ans.tokens) == len(ans.accepted) + sum(ans.accepted)


def test_a_partial_acceptance_cuts_the_block_table_and_the_request_goes_on(engines, reference):
    engine = engines("torch")
    router = MiniRouter(engine)
    prompt = PROMPTS[0]  # 13 tokens: the first sampled one sits at p = 13
    router.step(joined=[router.join(0, prompt)])
    ref = reference[0].tokens
    # 6 proposals, the first right: positions 14..19 span blocks 0 and 1 (16 tokens each)
    proposals = [ref[1], (ref[2] + 1) % 256, 3, 4, 5, 6]
    before = {0: router.reqs[0].computed}
    resp = router.step(continuing=[speculate(router, 0, proposals)])
    settle(router, resp, before)
    (g,) = resp.generations
    assert (g.num_proposed, g.num_accepted) == (6, 1)
    assert list(g.token_ids) == ref[1:3]
    state = engine.state
    assert state is not None
    slot = state.slot_of[0]
    p = len(prompt)
    assert int(state.computed[slot]) == p + 2  # t and the accepted proposal
    assert int(state.seq_lens[slot]) == p + 3
    assert int(state.num_block_ids[slot]) == 1 == len(router.reqs[0].blocks)  # ceil(15 / 16)
    assert state.tokens[slot, : p + 3].tolist() == prompt + ref[:3]
    # the next decodes reach the next block again, through the router's new blocks
    for _ in range(4):
        router.step(continuing=[router.cont(0)])
    assert router.reqs[0].tokens[p:] == ref[:7]
    assert int(state.num_block_ids[slot]) == 2


def _decode(rid: int, n: int = 1, **fields) -> shard_pb2.ContinuingRequest:
    return shard_pb2.ContinuingRequest(id=rid, num_compute=n, **fields)


def test_malformed_proposals_reject_the_step_and_the_next_step_runs(engines):
    engine = engines("torch")
    router = MiniRouter(engine)
    router.step(joined=[router.join(0, PROMPTS[0]), router.join(1, PROMPTS[1], num_compute=3)])
    vocab = engine.model.config.vocab_size
    cases = {
        "forced_tokens": _decode(0, 3, proposed_tokens=[5, 6], forced_tokens=[7]),
        "not 1 + 2": _decode(0, 2, proposed_tokens=[5, 6]),
        ">= vocab": _decode(0, 3, proposed_tokens=[5, vocab]),
        "without a draft model": _decode(0, 3, num_draft_tokens=2),
        "together": _decode(0, 3, proposed_tokens=[5, 6], num_draft_tokens=2),
        "decoding request": _decode(1, 3, proposed_tokens=[5, 6]),  # mid-prefill
    }
    state = engine.state
    assert state is not None
    snapshot = (state.seq_lens.clone(), state.computed.clone(), state.tokens.clone())
    for message, cont in cases.items():
        with pytest.raises(StepError, match=re.escape(message)):
            engine.step(shard_pb2.StepRequest(continuing=[cont]))
    with pytest.raises(StepError, match="has proposals"):
        engine.step(
            shard_pb2.StepRequest(
                continuing=[_decode(0, 3, proposed_tokens=[5, 6])],
                allowed=[allowed_tokens(0, [5], vocab)],
            )
        )
    assert torch.equal(snapshot[0], state.seq_lens) and torch.equal(snapshot[1], state.computed)
    assert torch.equal(snapshot[2], state.tokens)
    resp = router.step(continuing=[router.cont(0)])
    assert len(resp.generations) == 1


def test_synthetic_acceptance_keeps_router_proposals_at_the_set_rate(engines):
    rate = 0.5
    engine = engines("torch", speculative_acceptance=rate)
    router = MiniRouter(engine)
    rids = range(6)
    seeded = [shard_pb2.SamplingParams(seed=100 + r) for r in rids]
    router.step(joined=[router.join(r, PROMPTS[r % 2], sampling=seeded[r]) for r in rids])
    trials = kept = 0
    for step in range(30):
        before = {r: router.reqs[r].computed for r in rids}
        proposals = {r: [(17 * step + r + j) % 256 for j in range(K)] for r in rids}
        resp = router.step(continuing=[speculate(router, r, proposals[r]) for r in rids])
        settle(router, resp, before)
        for g in resp.generations:
            a = g.num_accepted
            assert list(g.token_ids[:a]) == proposals[g.id][:a] and len(g.token_ids) == a + 1
            kept += a
            trials += min(a + 1, K)  # the uniforms drawn until the first miss
    # each proposal kept with probability `rate` until the first miss: a binomial in trials
    assert trials > 150
    assert abs(kept / trials - rate) < 4 * (rate * (1 - rate) / trials) ** 0.5


class TargetCopyDraft:
    """A draft model (the interface of `cadence.speculative.draft.DraftModel`) that is the
    target itself: a second engine on the same weights prefills each row's tokens (with
    the proposals so far) and proposes from the target's processed distribution q, the
    argmax in greedy rows and otherwise a draw at the sampler's own uniform for (seed,
    position) -- which is the token decoding one at a time picks. Records the engine's
    calls."""

    name = "target copy"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.forgotten: list[int] = []
        self.verified: list[tuple[list[int], list[int]]] = []

    def forget(self, slots: list[int]) -> None:
        self.forgotten += slots

    def propose(self, state: BatchState, rows: list[tuple[int, int]], sampling: SamplingBatch):
        tokens, q_rows = [], []
        for i, (slot, k) in enumerate(rows):
            known = state.tokens[slot, : int(state.seq_lens[slot])].tolist()
            assert int(sampling.positions[i]) == len(known)  # before the proposals
            row = select_rows(sampling, torch.tensor([i]))
            for _ in range(k):
                router = MiniRouter(self.engine)
                joined = router.join(0, known, prompt_len=int(state.prompt_lens[slot]))
                logits = router.logits_step(joined=[joined], forced={0: 0})[0][-1:]
                router.step(removed=[router.remove(0)])
                row.history = torch.tensor([known])
                row.positions = row.seq_lens = torch.tensor([len(known)])
                q = processed_logprobs(logits, row)
                d = q.argmax(-1)
                if bool(row.params[0, DO_SAMPLE]):
                    d = draw(q.double().exp(), uniform_noise(row.seeds, row.positions))
                known.append(int(d))
                q_rows.append(q)
            tokens.append(known[-k:])
        return _Proposals(tokens, torch.cat(q_rows))

    def accepted(self, slots: list[int], computed: list[int]) -> None:
        self.verified.append((slots, computed))


@dataclass
class _Proposals:
    tokens: list[list[int]]
    q_logprobs: torch.Tensor | None


def _draft_run(engine: Engine, ks: dict[int, int]) -> dict[int, Answer]:
    router = MiniRouter(engine)
    answers = {rid: Answer() for rid in PROMPTS}
    joined = [router.join(r, p, sampling=SAMPLINGS[r], top_n=3) for r, p in PROMPTS.items()]
    for g in router.step(joined=joined).generations:
        answers[g.id].add(g)
    while live := [r for r in PROMPTS if len(answers[r].tokens) < N]:
        before = {r: router.reqs[r].computed for r in live}
        conts = []
        for r in live:
            k = min(ks[r], _room(answers[r].tokens))
            req = router.reqs[r]
            new = router._blocks_for(req, req.computed + 1 + k)
            conts.append(_decode(r, 1 + k, num_draft_tokens=k, new_blocks=new))
        resp = router.step(continuing=conts)
        settle(router, resp, before)
        for g in resp.generations:
            answers[g.id].add(g)
    return answers


def test_a_draft_that_is_the_target_is_always_accepted_and_decodes_as_the_target(
    engines, reference
):
    engine = engines("torch")
    draft = TargetCopyDraft(engines("torch"))
    engine.draft = draft  # type: ignore[assignment]
    got = _draft_run(engine, {0: K, 1: 3})
    # greedy row: sample and match; sampling row: rejection sampling, where p / q = 1
    for r, ref in reference.items():
        assert got[r].tokens == ref.tokens, r
        assert got[r].logprobs == pytest.approx(ref.logprobs, abs=TOL)
        assert got[r].accepted == got[r].proposed and sum(got[r].proposed) >= 8
    state = engine.state
    assert state is not None
    assert sorted(draft.forgotten) == sorted(state.slot_of.values())
    # after each step the draft hears its rows' computed counts: p + 1 + accepted
    request_of = {state.slot_of[r]: r for r in PROMPTS}
    computed = {r: len(PROMPTS[r]) for r in PROMPTS}
    for step, (slots, counts) in enumerate(draft.verified, start=1):
        for slot, count in zip(slots, counts, strict=True):
            r = request_of[slot]
            computed[r] += 1 + got[r].accepted[step]
            assert count == computed[r]


def test_two_ranks_verify_as_one_rank_does(model_dirs, engine_for, tmp_path):
    from tp_worker import run_group, speculative_generations

    path = model_dirs("llama_gqa")
    alone = speculative_generations(engine_for(path))
    assert [a for *_, a in alone] == [2] * 6  # two of three proposals right, every step
    for rank, results in enumerate(run_group(2, [str(path)], tmp_path, "float32", "speculative")):
        got = results["llama_gqa"]["speculative"]
        assert [(r, t, a) for r, t, _, a in got] == [(r, t, a) for r, t, _, a in alone], rank
        for (*_, lps, _), (*_, ref, _) in zip(got, alone, strict=True):
            assert lps == pytest.approx(ref, abs=TOL)

"""The draft model's proposals: its own greedy continuation of each request's context
(computed by a plain engine serving the draft's folder), through catch-up after partial
acceptance and re-joined slots; sampling rows' proposals and the distributions they were
drawn from; the vocabulary check; its KV bytes per block."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cadence.kv_format import kv_format
from cadence.pb import shard_pb2
from cadence.quant.setup import QuantizeConfig
from cadence.sampling import processed_logprobs, uniform_noise
from cadence.shard.backends import product_kernels
from cadence.shard.engine import Engine
from cadence.shard.state import BatchState
from cadence.speculative.draft import DraftModel
from cadence.speculative.draft_sampling import DRAFT_SALT
from shard_helpers import MiniRouter

TARGET, OTHER_DRAFT = "llama_gqa", "qwen2"  # both of vocabulary 256
GREEDY = shard_pb2.SamplingParams()
PENALIZED = shard_pb2.SamplingParams(repetition_penalty=1.8, frequency_penalty=0.7)
BIASED = shard_pb2.SamplingParams(logit_bias={5: 4.0, 17: 3.0, 200: -50.0})


def _draft_beside(
    engine: Engine,
    model_dir: Path | str,
    kv_cache_dtype: str = "",
    quantize: QuantizeConfig | None = None,
) -> DraftModel:
    """A draft on the engine's device, kernels and attention backend, its cache allocated."""
    assert engine.kv is not None
    draft = DraftModel(
        str(model_dir), engine.dtype, engine.device, quantize or QuantizeConfig(), engine.ops,
        engine.attention_backend, target_vocab_size=engine.model.config.vocab_size,
        block_size=engine.block_size,
        kv_format=kv_format(kv_cache_dtype) if kv_cache_dtype else engine.kv_format,
        pack_weights=engine.cfg.cpu_kernels,
    )  # fmt: skip
    draft.allocate(engine.kv.num_blocks)
    return draft


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Speculation:
    """The target's side of speculation for the draft: requests prefilled by the target
    engine, blocks reserved for the proposals, and the commit of a verified answer (the
    accepted proposals and the model's next token) as the verification makes it."""

    def __init__(self, engine: Engine, draft: DraftModel) -> None:
        self.engine = engine
        self.router = MiniRouter(engine)
        self.draft = draft
        assert engine.state is not None
        self.state: BatchState = engine.state

    def join(self, prompts: dict[int, tuple[list[int], shard_pb2.SamplingParams]]) -> None:
        """Prefills each prompt and samples its first token (which the target has not
        computed yet: the draft's first catch-up ends with it)."""
        joined = [self.router.join(i, p, sampling=s) for i, (p, s) in prompts.items()]
        self.router.step(joined=joined)
        self.draft.forget([self.state.slot_of[i] for i in prompts])

    def context(self, rid: int) -> list[int]:
        return list(self.router.reqs[rid].tokens)

    def propose(self, ks: dict[int, int]) -> dict[int, list[int]]:
        return self.propose_with_q(ks)[0]

    def propose_with_q(
        self, ks: dict[int, int]
    ) -> tuple[dict[int, list[int]], torch.Tensor | None]:
        state = self.state
        for rid, k in ks.items():  # the step's blocks cover positions p..p+k
            r = self.router.reqs[rid]
            new = self.router._blocks_for(r, len(r.tokens) + k)  # noqa: SLF001
            state.extend_blocks([shard_pb2.ContinuingRequest(id=rid, new_blocks=new)])
        ids = list(ks)
        slots = [state.slot_of[i] for i in ids]
        # the sampling inputs of the token after each one's known ones, as the engine's
        # step gives them (on its device)
        sb = self.engine._on_device(state.sampling_rows(torch.tensor(slots)))  # noqa: SLF001
        out = self.draft.propose(state, [(s, ks[i]) for s, i in zip(slots, ids, strict=True)], sb)
        assert [len(t) for t in out.tokens] == list(ks.values())
        return dict(zip(ids, out.tokens, strict=True)), out.q_logprobs

    def commit(self, rid: int, answer: list[int], speculated: bool = True) -> None:
        """The verified answer s_0..s_a: the request's computed count becomes p + 1 + a.
        Not `speculated`: a plain decode's token, which the draft is not told about."""
        state, r = self.state, self.router.reqs[rid]
        slot = state.slot_of[rid]
        p = len(r.tokens) - 1
        r.tokens += answer
        r.computed = p + len(answer)
        state.tokens[slot, p + 1 : p + 1 + len(answer)] = torch.tensor(answer)
        state.seq_lens[slot] = len(r.tokens)
        state.computed[slot] = r.computed
        if speculated:
            self.draft.accepted([slot], [r.computed])


def _continuation(
    engine: Engine, tokens: list[int], prompt_len: int, params: shard_pb2.SamplingParams, n: int
) -> list[int]:
    """What `engine` generates after `tokens` (the last one not computed yet), alone."""
    router = MiniRouter(engine)
    router.step(joined=[router.join(0, tokens, num_compute=len(tokens) - 1, prompt_len=prompt_len,
                                    sampling=params)])  # fmt: skip
    for _ in range(n):
        router.step(continuing=[router.cont(0)])
    generated = router.reqs[0].tokens[len(tokens) :]
    router.step(removed=[router.remove(0)])
    return generated


def test_with_the_targets_weights_greedy_proposals_are_the_targets_continuation(
    model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    path = model_dirs(TARGET)
    prompts = {0: _prompt(1, 3), 1: _prompt(2, 10), 2: _prompt(3, 20)}
    reference = MiniRouter(engine_for(path))
    expected = {}
    for i, p in prompts.items():  # each prompt's greedy continuation, without speculation
        reference.step(joined=[reference.join(10 + i, p)])
        for _ in range(14):
            reference.step(continuing=[reference.cont(10 + i)])
        expected[i] = reference.reqs[10 + i].tokens[len(p) :]
    engine = engine_for(path)
    spec = Speculation(engine, _draft_beside(engine, path))
    spec.join({i: (p, GREEDY) for i, p in prompts.items()})
    # every proposal is accepted, or the answer stops short of them (each answer is the
    # target's own tokens); the first catch-up is 4, 11 and 21 tokens, the later ones 1..3
    for ks, accepted in (
        ({0: 4, 1: 2, 2: 3}, {0: 4, 1: 0, 2: 1}),
        ({0: 3, 1: 4, 2: 2}, {0: 1, 1: 4, 2: 2}),
    ):
        proposals = spec.propose(ks)
        for i in prompts:
            g = len(spec.context(i)) - len(prompts[i])
            assert proposals[i] == expected[i][g : g + ks[i]], i
            spec.commit(i, expected[i][g : g + accepted[i] + 1])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_different_draft_proposes_its_own_continuation_after_partial_acceptance(
    backend: str, model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    """The draft's valid KV after an answer is what the target kept: the accepted
    proposals' positions, not the rejected ones' (later overwritten)."""
    target, draft_dir = model_dirs(TARGET), model_dirs(OTHER_DRAFT)
    engine = engine_for(target, attention_backend=backend)
    draft_alone = engine_for(draft_dir, attention_backend=backend)
    spec = Speculation(engine, _draft_beside(engine, draft_dir))
    params = {0: GREEDY, 1: PENALIZED, 2: BIASED}
    prompts = {0: _prompt(4, 2), 1: _prompt(5, 12), 2: _prompt(6, 25)}
    spec.join({i: (prompts[i], params[i]) for i in prompts})
    rounds = [({0: 3, 1: 4, 2: 2}, {0: 0, 1: 2, 2: 2}), ({0: 4, 1: 1, 2: 3}, {0: 3, 1: 1, 2: 0})]
    for ks, accepted in rounds + [({0: 2, 1: 3, 2: 4}, {0: 1, 1: 1, 2: 1})]:
        proposals = spec.propose(ks)
        for i, k in ks.items():
            context = spec.context(i)
            own = _continuation(draft_alone, context, len(prompts[i]), params[i], k)
            assert proposals[i] == own, (i, ks)
            # the accepted proposals, then a token of the target's other than the next one
            a = accepted[i]
            rejected = proposals[i][a] if a < k else -1
            spec.commit(i, proposals[i][:a] + [(rejected + 1) % 256 if a < k else 7])
        # plain decodes in between (speculation off for a while): the positions of the
        # rejected proposals are behind the next catch-up's end now
        for i in ks:
            for t in (40, 41, 42, 43, 44):
                spec.commit(i, [t], speculated=False)


def test_penalties_count_the_proposals_drafted_before(
    model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    """A repetition penalty strong enough to change the greedy continuation: the
    proposals are the penalized one, each penalizing the proposals before it."""
    draft_dir = model_dirs(OTHER_DRAFT)
    engine, draft_alone = engine_for(model_dirs(TARGET)), engine_for(draft_dir)
    spec = Speculation(engine, _draft_beside(engine, draft_dir))
    prompt = _prompt(7, 6)
    harsh = shard_pb2.SamplingParams(repetition_penalty=50.0, presence_penalty=5.0)
    spec.join({0: (prompt, harsh)})
    (proposals,) = spec.propose({0: 8}).values()
    context = spec.context(0)
    assert proposals == _continuation(draft_alone, context, len(prompt), harsh, 8)
    assert proposals != _continuation(draft_alone, context, len(prompt), GREEDY, 8)
    assert len(set(proposals)) == 8  # no proposal repeats an earlier one


def test_a_slot_rejoined_by_another_request_is_forgotten(
    model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    target, draft_dir = model_dirs(TARGET), model_dirs(OTHER_DRAFT)
    engine, draft_alone = engine_for(target), engine_for(draft_dir)
    spec = Speculation(engine, _draft_beside(engine, draft_dir))
    first = _prompt(8, 9)
    spec.join({0: (first, GREEDY)})
    slot = spec.state.slot_of[0]
    spec.commit(0, spec.propose({0: 3})[0])  # the draft cache now holds 12 positions
    spec.router.step(removed=[spec.router.remove(0)])
    second = first[:4] + _prompt(9, 4)  # shorter than what the slot held, its start shared
    spec.join({1: (second, GREEDY)})
    assert spec.state.slot_of[1] == slot
    context = spec.context(1)
    assert spec.propose({1: 4})[1] == _continuation(draft_alone, context, len(second), GREEDY, 4)


def _reference_q(
    engine: Engine, context: list[int], prompt_len: int, params: shard_pb2.SamplingParams,
    proposals: list[int],
) -> torch.Tensor:  # fmt: skip
    """The processed distributions of `engine`'s model at each proposal, given the
    proposals before it: one decode per proposal, forced to it."""
    router = MiniRouter(engine)
    router.step(joined=[router.join(0, context, num_compute=len(context) - 1,
                                    prompt_len=prompt_len, sampling=params)])  # fmt: skip
    state = engine.state
    assert state is not None
    rows = []
    for d in proposals:
        sb = engine._on_device(state.sampling_batch(state.prepare([(0, 1)])))  # noqa: SLF001
        logits = router.logits_step(continuing=[router.cont(0)], forced={0: d})[0][-1:]
        rows.append(processed_logprobs(logits, sb))
    router.step(removed=[router.remove(0)])
    return torch.cat(rows)


def test_sampling_rows_are_drawn_from_the_distributions_they_report(
    model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    draft_dir = model_dirs(OTHER_DRAFT)
    engine, draft_alone = engine_for(model_dirs(TARGET)), engine_for(draft_dir)
    spec = Speculation(engine, _draft_beside(engine, draft_dir))
    warm = shard_pb2.SamplingParams(do_sample=True, temperature=1.4, top_k=40, seed=1234)
    other = shard_pb2.SamplingParams(do_sample=True, temperature=1.4, top_k=40, seed=99)
    penalized = shard_pb2.SamplingParams(
        do_sample=True, temperature=0.9, top_p=0.9, repetition_penalty=1.3, seed=1234
    )
    prompt = _prompt(10, 7)
    params = {0: warm, 1: GREEDY, 2: warm, 3: other, 4: penalized}
    spec.join({i: (prompt, p) for i, p in params.items()})
    ks = {0: 4, 1: 2, 2: 4, 3: 4, 4: 3}
    proposals, q = spec.propose_with_q(ks)
    assert q is not None and q.shape == (sum(ks.values()), 256) and q.dtype == torch.float32
    q = q.cpu()
    start = 0
    for i, k in ks.items():  # each request's own first sampled token ends its context
        rows = q[start : start + k]
        start += k
        context = spec.context(i)
        expected = _reference_q(draft_alone, context, len(prompt), params[i], proposals[i])
        torch.testing.assert_close(rows, expected.cpu(), atol=2e-5, rtol=1e-5)
        # each proposal lies where its distribution has mass
        assert bool(rows.gather(1, torch.tensor(proposals[i]).unsqueeze(1)).isfinite().all())
    for i in (0, 3, 4):  # the draw: an inverse CDF at a uniform of (seed, position, salt)
        seed = torch.tensor([params[i].seed])
        cdf = q[sum(list(ks.values())[:i]) :][: ks[i]].double().exp().cumsum(dim=-1)
        for j, d in enumerate(proposals[i]):
            position = torch.tensor([len(prompt) + 1 + j])
            u = uniform_noise(seed, position, DRAFT_SALT) * cdf[j, -1]
            assert int(torch.searchsorted(cdf[j], u, right=True)) == d
    greedy = _continuation(draft_alone, spec.context(1), len(prompt), GREEDY, 2)
    assert proposals[1] == greedy
    assert (
        spec.context(0) == spec.context(2) and proposals[0] == proposals[2]
    )  # one seed, one answer
    assert proposals[0] != proposals[3]
    # the same seed alone in a fresh batch draws the same proposals
    engine = engine_for(model_dirs(TARGET))
    alone = Speculation(engine, _draft_beside(engine, draft_dir))
    alone.join({7: (prompt, warm)})
    assert alone.propose({7: 4})[7] == proposals[0]


def test_an_all_greedy_batch_reports_no_distributions(
    model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    engine = engine_for(model_dirs(TARGET))
    spec = Speculation(engine, _draft_beside(engine, model_dirs(OTHER_DRAFT)))
    spec.join({0: (_prompt(11, 5), GREEDY), 1: (_prompt(12, 5), PENALIZED)})
    assert spec.propose_with_q({0: 2, 1: 3})[1] is None


@pytest.mark.parametrize("source", ["int8", "int4", "gguf"])
def test_a_quantized_or_gguf_draft_proposes_what_its_folder_serves(
    source: str,
    model_dirs: Callable[[str], Path],
    engine_for: Callable[..., Engine],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--draft-quantize, and a .gguf --draft-model-id resolved as --model-id is: the
    proposals are the greedy continuation of a plain engine serving the same folder with
    the same quantization."""
    if source == "gguf":
        from cadence.model_source import resolve_model
        from gguf_helpers import tiny_model, write_gguf

        monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
        files = {}
        for arch in ("llama", "qwen2"):  # one vocabulary: the helpers' tokenizer's
            files[arch] = tmp_path / f"tiny-{arch}.gguf"
            write_gguf(arch, tiny_model(arch), files[arch])
        target, draft_dir = (resolve_model(str(files[a])) for a in ("llama", "qwen2"))
    else:
        target, draft_dir = str(model_dirs(TARGET)), str(model_dirs(OTHER_DRAFT))
    # no float copy: int4's products of few rows and of many would round differently
    engine = engine_for(target)
    products = product_kernels(engine.device)
    method = None if source == "gguf" else source
    quantize = QuantizeConfig(method, keep_float="off", products=products)
    draft = _draft_beside(engine, draft_dir, quantize=quantize)
    assert draft.model.quantization
    draft_alone = engine_for(
        draft_dir, quantize=quantize.method, quantize_keep_float=quantize.keep_float
    )
    spec = Speculation(engine, draft)
    prompt = _prompt(13, 21)
    spec.join({0: (prompt, GREEDY)})
    for accepted in (1, 3):
        proposals = spec.propose({0: 4})[0]
        context = spec.context(0)
        assert proposals == _continuation(draft_alone, context, len(prompt), GREEDY, 4)
        spec.commit(0, proposals[:accepted] + [(proposals[accepted] + 1) % 256])


def test_a_draft_of_another_vocabulary_is_refused(
    model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    engine = engine_for(model_dirs(TARGET))
    with pytest.raises(ValueError, match=r"vocabulary of 257 tokens.*one of 256"):
        _draft_beside(engine, model_dirs("llama_kv1_odd_vocab"))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "int8"])
def test_the_draft_kv_bytes_per_block_are_its_own_cache_in_the_targets_format(
    kv_cache_dtype: str, model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    # the target has 4 KV heads, the draft 2 (of head dim 16, in 2 layers)
    engine = engine_for(model_dirs("llama_mha_tied"), num_blocks=24)
    draft = _draft_beside(engine, model_dirs(OTHER_DRAFT), kv_cache_dtype)
    assert draft.kv is not None and draft.kv.num_blocks == 24
    held = draft.kv.blocks.nbytes
    if draft.kv.token_scales is not None:
        held += draft.kv.token_scales.nbytes
    assert draft.bytes_per_block == held // 24
    element = {"float32": 4, "bfloat16": 2, "int8": 1}[kv_cache_dtype]
    scales = 4 if kv_cache_dtype == "int8" else 0  # a float32 scale per token and KV head
    block = engine.block_size
    assert draft.bytes_per_block == 2 * 2 * block * 2 * (16 * element + scales)
    assert tuple(draft.kv.blocks.shape) == (2, 2, 24, block, 2, 16)


def _speculative_decode(
    engine: Engine, prompts: dict[int, list[int]], params: dict[int, shard_pb2.SamplingParams],
    n: int, k: int,
) -> tuple[dict[int, list[int]], dict[int, list[tuple[int, int]]]]:  # fmt: skip
    """`n` tokens per request through Engine.step, each decode asking the engine's draft
    for up to `k` proposals as the router does (never past `n`), the blocks the rejected
    proposals were written to returned after each answer. The generated tokens, and the
    (proposed, accepted) counts of each step."""
    router = MiniRouter(engine)
    router.step(joined=[router.join(i, p, sampling=params[i]) for i, p in prompts.items()])
    counts: dict[int, list[tuple[int, int]]] = {i: [] for i in prompts}
    generated = {i: lambda i=i: len(router.reqs[i].tokens) - len(prompts[i]) for i in prompts}
    while live := [i for i in prompts if generated[i]() < n]:
        conts, before = [], {}
        for i in live:
            r, ask = router.reqs[i], min(k, n - generated[i]() - 1)
            before[i] = r.computed
            new = router._blocks_for(r, r.computed + 1 + ask)  # noqa: SLF001
            conts.append(shard_pb2.ContinuingRequest(
                id=i, num_compute=1 + ask, new_blocks=new, num_draft_tokens=ask
            ))  # fmt: skip
        for g in router.step(continuing=conts).generations:
            r = router.reqs[g.id]
            r.computed = before[g.id] + 1 + g.num_accepted
            keep = -(-r.computed // router.bs)
            router.free += r.blocks[keep:]
            del r.blocks[keep:]
            counts[g.id].append((g.num_proposed, g.num_accepted))
    return {i: router.reqs[i].tokens[len(p) :] for i, p in prompts.items()}, counts


@pytest.mark.parametrize("draft_name", [TARGET, OTHER_DRAFT])
def test_engine_steps_with_the_draft_decode_as_the_target_alone(
    draft_name: str, model_dirs: Callable[[str], Path], engine_for: Callable[..., Engine]
) -> None:
    """Greedy rows through the engine's speculative step (the draft proposes, the target
    verifies): the target's own tokens, whatever the draft; all of them accepted when the
    draft is the target's weights."""
    path = model_dirs(TARGET)
    prompts = {0: _prompt(14, 5), 1: _prompt(15, 19), 2: _prompt(16, 9)}
    params = {0: GREEDY, 1: PENALIZED, 2: BIASED}
    engine = engine_for(path)
    engine.draft = _draft_beside(engine, model_dirs(draft_name))
    got, counts = _speculative_decode(engine, prompts, params, 12, 4)
    reference = MiniRouter(engine_for(path))
    reference.step(joined=[reference.join(i, p, sampling=params[i]) for i, p in prompts.items()])
    for _ in range(11):
        reference.step(continuing=[reference.cont(i) for i in prompts])
    for i, p in prompts.items():
        assert got[i] == reference.reqs[i].tokens[len(p) :], i
        if draft_name == TARGET:  # 1 + 4 + 1 + 4 + 1 + 1 tokens
            assert counts[i] == [(4, 4), (4, 4), (0, 0)], i
    if draft_name == OTHER_DRAFT:  # its proposals were rejected, some accepted
        steps = [c for i in prompts for c in counts[i]]
        assert any(a < k for k, a in steps) and any(a > 0 for _, a in steps)

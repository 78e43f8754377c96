"""Batch invariance inside one engine (docs/determinism.md): a request's logits are the same
bits alone, inside steps of random other requests with random prompt chunks, after a
prefix-cache hit, recomputed after a preemption, and with its next tokens computed several
per row (as a speculative verification computes them) -- for float32, bfloat16 and the
integer product's int4 weights. And the start-up check that keeps each product kernel to
the row counts where it agrees with itself."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from cadence.layers.linear import product
from cadence.pb import shard_pb2
from cadence.shard import determinism
from cadence.shard.determinism import varying_product
from cadence.shard.determinism_cache import CheckCache, machine
from cadence.shard.engine import Engine
from shard_helpers import MiniRouter

PROMPT = 45  # tokens: two full blocks and a partial one
FOLLOW = 6  # tokens after the prompt: the logits of the prompt's last and of 5 more
VOCAB_LOW, VOCAB_HIGH = 3, 120

CONFIGS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int4": {"dtype": "bfloat16", "quantize": "int4"},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def engine(request, model_dirs, engine_for) -> Engine:
    engine = engine_for(model_dirs("llama_gqa"), num_blocks=400, **CONFIGS[request.param])
    assert engine.determinism.on, engine.determinism.detail
    return engine


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


PROMPT_IDS = tokens(random.Random(7), PROMPT + FOLLOW)


def finish(router: MiniRouter) -> None:
    ids = list(router.reqs)
    for rid in ids:
        router.remove(rid)
    router.step(removed=ids)


def alone(engine: Engine) -> torch.Tensor:
    """Logits of the probed request's prompt (last row) and of each following token: one
    prefill, then one decode per token."""
    router = MiniRouter(engine)
    rows = [router.logits_step(joined=[router.join(1, PROMPT_IDS[:PROMPT])],
                               forced={1: PROMPT_IDS[PROMPT]})[1][-1:]]  # fmt: skip
    for t in PROMPT_IDS[PROMPT + 1 :]:
        rows.append(router.logits_step(continuing=[router.cont(1)], forced={1: t})[1])
    finish(router)
    return torch.cat(rows)


def in_a_crowd(engine: Engine, seed: int) -> torch.Tensor:
    """The same, with its prompt in random chunks, beside 1-24 other requests whose own
    prompts are chunked at random and which decode while it does."""
    rng = random.Random(seed)
    router = MiniRouter(engine)
    others = {10 + i: tokens(rng, rng.randint(1, 90)) for i in range(rng.randint(1, 24))}
    forced = {rid: rng.randrange(VOCAB_LOW, VOCAB_HIGH) for rid in others}
    first = rng.randint(1, PROMPT - 1)
    joined = [router.join(1, PROMPT_IDS[:PROMPT], num_compute=first)]
    for rid, ids in others.items():
        joined.append(router.join(rid, ids, num_compute=rng.randint(1, len(ids))))
    rows: list[torch.Tensor] = []
    out = router.logits_step(joined=joined, forced={1: PROMPT_IDS[PROMPT], **forced})
    done = first
    while len(rows) < FOLLOW:
        cont = []
        for rid, r in router.reqs.items():
            left = len(r.tokens) - r.computed
            if rid == 1 and done < PROMPT:
                n = rng.randint(1, PROMPT - done)
                done += n
                cont.append(router.cont(1, num_compute=n))
            elif rid != 1 and left > 0:
                cont.append(router.cont(rid, num_compute=rng.randint(1, left)))
            else:
                cont.append(router.cont(rid))
        nxt = PROMPT_IDS[PROMPT + len(rows)]
        out = router.logits_step(continuing=cont, forced={1: nxt, **forced})
        if done == PROMPT and router.reqs[1].computed >= PROMPT:
            rows.append(out[1][-1:])
    finish(router)
    return torch.cat(rows)


def after_a_prefix_hit(engine: Engine) -> torch.Tensor:
    """The prompt's full blocks computed by an earlier request, read from the cache."""
    router = MiniRouter(engine)
    router.logits_step(joined=[router.join(2, PROMPT_IDS[:PROMPT])], forced={2: 0})
    cached = (PROMPT // router.bs) * router.bs
    shared = router.reqs[2].blocks[: cached // router.bs]
    fresh = [router.free.pop() for _ in range(-(-PROMPT // router.bs) - len(shared) + 1)]
    router.reqs[1] = type(router.reqs[2])(list(PROMPT_IDS[:PROMPT]), PROMPT, PROMPT)
    router.reqs[1].blocks = shared + fresh
    joined = shard_pb2.NewRequest(
        id=1, token_ids=PROMPT_IDS[:PROMPT], prompt_len=PROMPT, num_cached=cached,
        num_compute=PROMPT - cached, block_table=shared + fresh,
        sampling=shard_pb2.SamplingParams(),
    )  # fmt: skip
    rows = [router.logits_step(joined=[joined], forced={1: PROMPT_IDS[PROMPT]})[1][-1:]]
    for t in PROMPT_IDS[PROMPT + 1 :]:
        rows.append(router.logits_step(continuing=[router.cont(1)], forced={1: t})[1])
    router.reqs[2].blocks = router.reqs[2].blocks[len(shared) :]  # freed once, by request 1
    finish(router)
    return torch.cat(rows)


def recomputed(engine: Engine) -> torch.Tensor:
    """Preempted after three tokens, then recomputed: prompt and generated tokens
    prefilled together, as the router resumes a preempted request."""
    router = MiniRouter(engine)
    rows = [router.logits_step(joined=[router.join(1, PROMPT_IDS[:PROMPT])],
                               forced={1: PROMPT_IDS[PROMPT]})[1][-1:]]  # fmt: skip
    for t in PROMPT_IDS[PROMPT + 1 : PROMPT + 3]:
        rows.append(router.logits_step(continuing=[router.cont(1)], forced={1: t})[1])
    finish(router)
    known = PROMPT_IDS[: PROMPT + 3]
    out = router.logits_step(joined=[router.join(1, known, prompt_len=PROMPT)],
                             forced={1: PROMPT_IDS[PROMPT + 3]})  # fmt: skip
    rows.append(out[1][-1:])
    for t in PROMPT_IDS[PROMPT + 4 :]:
        rows.append(router.logits_step(continuing=[router.cont(1)], forced={1: t})[1])
    finish(router)
    return torch.cat(rows)


def several_per_row(engine: Engine) -> torch.Tensor:
    """The following tokens computed three to a row, as a verification of proposals is."""
    router = MiniRouter(engine)
    rows = [router.logits_step(joined=[router.join(1, PROMPT_IDS[:PROMPT])],
                               forced={1: PROMPT_IDS[PROMPT]})[1][-1:]]  # fmt: skip
    fed = PROMPT + 1
    while fed < len(PROMPT_IDS):
        extra = PROMPT_IDS[fed : min(fed + 2, len(PROMPT_IDS) - 1)]
        nxt = PROMPT_IDS[fed + len(extra)] if fed + len(extra) < len(PROMPT_IDS) else 0
        rows.append(router.logits_step(continuing=[router.cont(1, forced=extra)],
                                       forced={1: nxt})[1])  # fmt: skip
        fed += len(extra) + 1
    finish(router)
    return torch.cat(rows)


def test_a_request_gets_the_same_logits_in_every_situation(engine: Engine) -> None:
    expected = alone(engine)
    assert expected.shape[0] == FOLLOW
    assert torch.equal(alone(engine), expected)
    for seed in range(4):
        assert torch.equal(in_a_crowd(engine, seed), expected), f"crowd {seed}"
    assert torch.equal(after_a_prefix_hit(engine), expected)
    assert torch.equal(recomputed(engine), expected)
    assert torch.equal(several_per_row(engine), expected)


def test_the_start_up_check_finds_every_product_row_invariant(engine: Engine) -> None:
    """Each product, at any row count, gives a row the bits it gives that row alone (the
    check's ranges applied), and the check keeps its answer when run again."""
    assert varying_product(engine.model, engine.dtype) == ""
    layer = engine.model.model.layers[0].mlp.down_proj
    x = torch.randn(300, layer.in_features).to(engine.dtype)
    whole = product(layer, x, None)
    for m in (1, 2, 7, 64, 299):
        assert torch.equal(product(layer, x[:m], None), whole[:m]), m


def test_products_split_and_pad_in_order(engine: Engine) -> None:
    """A layer kept to 2..5 rows: more rows are multiplied five at a time, one row padded."""
    layer = engine.model.model.layers[0].self_attn.o_proj
    saved = layer.min_rows, layer.max_rows
    x = torch.randn(12, layer.in_features).to(engine.dtype)
    try:
        layer.min_rows, layer.max_rows = 2, 5
        pieces = [product(layer, x[i : i + 5], None) for i in range(0, 12, 5)]
        assert torch.equal(product(layer, x, None), torch.cat(pieces))
        padded = product(layer, torch.cat([x[:1], torch.zeros_like(x[:1])]), None)[:1]
        assert torch.equal(product(layer, x[:1], None), padded)
    finally:
        layer.min_rows, layer.max_rows = saved


def test_without_the_flag_the_shard_says_so(model_dirs, engine_for) -> None:
    engine = engine_for(model_dirs("llama_gqa"), deterministic=False)
    assert engine.determinism.describe() == "off: turned off (--no-deterministic)"
    assert engine.kernels["determinism"] == engine.determinism.describe()
    assert "torch SDPA prefill" in engine.kernels["attention"]


def test_the_check_s_answers_are_kept_per_machine_and_read_back(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second start on the same machine reads every answer instead of multiplying;
    another machine's key checks anew; a stored "no range agrees" is honoured."""
    path = tmp_path / "checks.json"
    first = CheckCache(path, "machine A")
    assert varying_product(engine.model, engine.dtype, first) == ""
    first.save()
    stored = json.loads(path.read_text())["machine A"]
    assert stored and all(v is not None and v[0] >= 1 for v in stored.values()), stored
    ranges = [(m.min_rows, m.max_rows) for m in engine.model.modules() if hasattr(m, "min_rows")]

    checked: list[object] = []
    real = determinism._agreeing_range
    monkeypatch.setattr(determinism, "_agreeing_range", lambda *a: checked.append(a[0]) or real(*a))
    again = CheckCache(path, "machine A")
    assert varying_product(engine.model, engine.dtype, again) == ""
    assert checked == [] and again.new == {}
    assert ranges == [
        (m.min_rows, m.max_rows) for m in engine.model.modules() if hasattr(m, "min_rows")
    ]

    other = CheckCache(path, "machine B")
    assert varying_product(engine.model, engine.dtype, other) == ""
    assert len(checked) == len(stored)
    other.save()
    assert set(json.loads(path.read_text())) == {"machine A", "machine B"}

    (key, _), *_ = stored.items()
    path.write_text(json.dumps({"machine C": {key: None}}))
    assert "changes with the row count" in varying_product(
        engine.model, engine.dtype, CheckCache(path, "machine C")
    )
    path.write_text("not json")  # a broken file is ignored: checked anew
    assert varying_product(engine.model, engine.dtype, CheckCache(path, "machine C")) == ""


def test_the_machine_key_names_what_changes_a_kernel_s_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = machine("avx2", torch.float32)
    assert "threads" in plain and "float32" in plain and "torch " in plain
    assert machine("avx2", torch.bfloat16) != plain
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in machine("avx2", torch.float32)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert machine("avx2", torch.float32) != plain
    finally:
        torch.set_num_threads(threads)


def test_a_kernel_alike_only_up_to_32_rows_is_split_into_32_row_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """oneDNN's bfloat16 product on AMX (a Sapphire Rapids) gives a row the same bits at every
    count up to 32 rows and other bits from 33 on, where padding cannot help: the check
    splits such a product into 32-row ones, and no range is found for a kernel that never
    agrees with itself."""
    from types import SimpleNamespace

    from cadence.layers import linear as linear_module

    # small integers: every sum exact, whatever its order, so the bits change only as told
    def by_rows(x, weight, bias, packed, packed_max_rows):  # other bits above 32 rows
        return x @ weight.T + (0.5 if x.shape[0] > 32 else 0.0)

    monkeypatch.setattr(linear_module, "linear", by_rows)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-4, 5, (96, 256), generator=generator).float()
    layer = SimpleNamespace(
        weight=weight,
        packed_weight=None,
        packed_max_rows=None,
        quantized=None,
        min_rows=1,
        max_rows=1 << 30,
    )
    rows = max(determinism.CHECK_ROWS) + determinism.OFFSET
    x = torch.randint(-4, 5, (rows, 256), generator=generator).float()
    found = determinism._agreeing_range(layer, x, determinism.CHECK_ROWS, determinism.SPLIT, 64)
    assert found == (1, 32)

    def never_alike(x, weight, bias, packed, packed_max_rows):  # each count its own bits
        return x @ weight.T + x.shape[0]

    monkeypatch.setattr(linear_module, "linear", never_alike)
    assert determinism._agreeing_range(layer, x, determinism.CHECK_ROWS, 512, 64) is None
    assert (layer.min_rows, layer.max_rows) == (1, 512)

"""End to end against PEFT: an adapter folder saved by PEFT, loaded by the shard
(LoadAdapter's parse), paged into the KV pool and used by a request beside a request
without one, gives PEFT's own logits for the adapter's request (a prefill, then decodes)
and the base model's for the other."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import make_peft_adapter, peft_model
from lora_script import page_in
from shard_helpers import MiniRouter, hf_logits

TARGETS = {
    "llama_gqa": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_peft_adapter_served_from_the_pool_gives_peft_logits(
    name, model_dirs, engine_for, hf_model, tmp_path
):
    model_dir = model_dirs(name)
    folder = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, target_modules=TARGETS[name])
    engine = engine_for(model_dir)
    loaded = engine.adapters.load("peft", str(folder))
    assert loaded.num_blocks > 0 and loaded.max_rank == 4
    router = MiniRouter(engine)
    page_in(engine, router, ["peft"])
    prompt, follow = list(range(20, 37)), [41, 42, 43]
    with_adapter = router.join(1, prompt)
    with_adapter.adapter_id = "peft"
    base = router.join(2, prompt)
    got = {1: [], 2: []}
    out = router.logits_step(joined=[with_adapter, base], forced={1: follow[0], 2: follow[0]})
    for t in follow[1:]:
        for rid, logits in out.items():
            got[rid].append(logits)
        out = router.logits_step(continuing=[router.cont(1), router.cont(2)], forced={1: t, 2: t})
    for rid, logits in out.items():
        got[rid].append(logits)
    tokens = prompt + follow[:-1]
    want_peft = hf_logits(peft_model(model_dir, folder), tokens)
    want_base = hf_logits(hf_model(model_dir), tokens)
    torch.testing.assert_close(torch.cat(got[1]), want_peft, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(got[2]), want_base, atol=1e-4, rtol=0)
    assert (want_peft - want_base).abs().max() > 1e-2  # the adapter matters

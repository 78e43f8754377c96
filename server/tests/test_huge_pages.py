"""The shard's long-lived tensors on 2 MB pages (`cadence.huge_pages`): zeros like
torch's, mappings that live as long as any view, and packed weights that, moved, give
the same logits bit for bit."""

from __future__ import annotations

import gc

import pytest
import torch
from cadence import huge_pages
from cadence.shard.engine import Engine
from shard_helpers import MiniRouter

MB = 1 << 20


def _huge_page_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (0 where unreadable)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _logits(engine: Engine, rid: int, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of tokens[:-1] for request `rid`: a prefill of `prompt_len`, then decodes."""
    router = MiniRouter(engine)
    first = router.join(rid, tokens[:prompt_len])
    got = [router.logits_step(joined=[first], forced={rid: tokens[prompt_len]})[rid]]
    for t in tokens[prompt_len + 1 :]:
        got.append(router.logits_step(continuing=[router.cont(rid)], forced={rid: t})[rid])
    return torch.cat(got)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.bfloat16])
def test_zeros_are_torch_zeros_from_a_huge_page_boundary(dtype):
    shape = (3, 5, 8 * MB // 15)
    t = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t[2, 4, -1] = 7  # writable to the last element
    assert t.sum().item() == 7


def test_a_view_keeps_the_mapping_alive():
    t = huge_pages.zeros((4, MB), torch.int8)
    view = t[3]
    del t
    gc.collect()
    view.fill_(1)
    assert view.sum().item() == MB


def test_below_a_huge_page_stays_on_torchs_allocator():
    small = huge_pages.zeros((16, 16), torch.float32)
    assert torch.equal(small, torch.zeros(16, 16))
    assert small.untyped_storage().nbytes() == 16 * 16 * 4  # no mapping of its own


def test_no_huge_pages_keeps_the_engine_on_torchs_allocator(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"), num_blocks=4096, huge_pages=False)
    assert engine.packed_on_huge_pages == 0
    assert engine.kv.blocks.nbytes >= huge_pages.HUGE_PAGE  # big enough to have moved
    # torch's allocator: a chunk header before the data, never a 2 MB boundary
    assert engine.kv.blocks.data_ptr() % huge_pages.HUGE_PAGE != 0


@pytest.mark.skipif(
    huge_pages.thp_mode() not in ("always", "madvise") or not huge_pages.supported(),
    reason=f"transparent huge pages here: {huge_pages.thp_mode()}",
)
def test_the_kernel_gives_huge_pages_where_it_has_them():
    before = _huge_page_bytes()
    t = huge_pages.zeros((32, MB), torch.int8)
    # at least one 2 MB page (the kernel may fall short of all under fragmentation)
    assert _huge_page_bytes() - before >= huge_pages.HUGE_PAGE
    del t


def test_moved_packed_weights_serve_the_same_logits(model_dirs, engine_for):
    # the integer product's packed weights: plain tensors on every CPU with the kernels
    engine = engine_for(
        model_dirs("llama_gqa"), quantize="int8", quantize_keep_float="off", huge_pages=False
    )
    tokens = list(range(5, 30))
    before = _logits(engine, 1, tokens, 20)
    old = [slot.tensor for slot in huge_pages._packed_tensors(engine.model)]
    assert old, "the integer product packs its weights: something to move"
    moved = huge_pages.place_packed_weights(engine.model, min_bytes=0)
    assert moved >= sum(t.nbytes for t in old)
    now = [slot.tensor for slot in huge_pages._packed_tensors(engine.model)]
    # one mapping, in order: each starts where the one before ends, rounded to ALIGN
    ends = [t.data_ptr() + -(-t.nbytes // huge_pages.ALIGN) * huge_pages.ALIGN for t in now]
    assert [t.data_ptr() for t in now[1:]] == ends[:-1]
    assert now[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for a, b in zip(old, now, strict=True):
        assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    for t in old:  # a product still reading an old copy would now read zeros
        t.zero_()
    after = _logits(engine, 2, tokens, 20)
    assert torch.equal(before, after)


def test_the_engine_holds_its_pool_on_huge_pages(model_dirs, engine_for):
    engine = engine_for(model_dirs("llama_gqa"), num_blocks=4096)
    assert engine.kv.blocks.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert engine.packed_on_huge_pages == 0  # a tiny model's: under one huge page

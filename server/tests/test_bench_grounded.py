"""`cadence bench --dataset-name grounded`: prompts of exactly the asked token length,
template included, holding a passage of the corpus the answer is to copy."""

from __future__ import annotations

import numpy as np
import pytest
from cadence_bench.datasets import (
    CORPUS,
    GROUNDED_TASKS,
    GroundedPromptMaker,
    add_typos,
    grounded_dataset,
    load_chat_renderer,
    load_tokenizer,
)
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def maker(tok: Tokenizer) -> GroundedPromptMaker:
    return GroundedPromptMaker(tok, load_chat_renderer(None), np.random.default_rng(7))


def _count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def test_prompts_have_exact_token_lengths(tok: Tokenizer) -> None:
    render = load_chat_renderer(None)
    reqs = grounded_dataset(tok, render, 24, (80, 400), (16, 32), seed=3)
    # the lengths are the dataset's first draws from its seed
    asked = [int(x) for x in np.random.default_rng(3).integers(80, 401, size=24)]
    assert [r.prompt_len for r in reqs] == asked
    for r in reqs:
        assert _count(tok, r.prompt) == r.prompt_len
        assert 16 <= r.output_len <= 32


def test_prompt_is_the_chat_template_around_a_task_and_a_corpus_passage(
    tok: Tokenizer, maker: GroundedPromptMaker
) -> None:
    corpus = CORPUS.read_text()
    words = set(corpus.split())
    for i in range(2 * len(GROUNDED_TASKS)):
        instruction, typos = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
        prompt, passage = maker.make(200)
        assert _count(tok, prompt) == 200
        # SmolLM2's template: the default system turn, the user turn, the assistant's start.
        assert prompt.startswith("<|im_start|>system\n")
        assert prompt.endswith(f"{instruction}\n\n{passage}<|im_end|>\n<|im_start|>assistant\n")
        assert len(passage.split()) > 100
        if typos:
            changed = [w for w in passage.split() if w not in words]
            assert 1 <= len(changed) < len(passage.split()) // 5
        else:
            assert passage in corpus + corpus  # a window may wrap past the end


def test_typos_swap_inner_letters_only() -> None:
    text = "the harbor fishermen carried wooden baskets"
    out = add_typos(text, np.random.default_rng(0), rate=1.0)
    assert out != text
    for a, b in zip(text.split(), out.split(), strict=True):
        assert sorted(a) == sorted(b) and a[0] == b[0] and a[-1] == b[-1]
        assert a == b or len(a) >= 5


def test_too_short_a_prompt_is_refused(maker: GroundedPromptMaker) -> None:
    with pytest.raises(ValueError, match="need more than"):
        maker.make(10)

"""`--reasoning-parser` through `cadence launch` on a tiny random Qwen3 whose template
opens `<think>` (and writes the empty block with `enable_thinking: false`), driven by the
real `openai` and `anthropic` SDKs. The reference: the same server's `/v1/completions` on
the prompt the template renders (transformers renders it here), which no parser touches:
the reasoning is its text up to `</think>`, the answer the rest, character for character.
The model's LM head makes it write `</think>` a few tokens in (`tiny_qwen3_dir`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from conftest import (
    FLOAT32,
    THINKING_QUESTION,
    THINKING_TOKENS,
    TINY_BLOCK_BYTES_FLOAT32,
    LaunchedServer,
    launch,
    stop,
    thinking_prompt,
)

MESSAGES = [{"role": "user", "content": THINKING_QUESTION}]
GREEDY = {"temperature": 0}
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: str
) -> Iterator[LaunchedServer]:
    memory = str(64 * TINY_BLOCK_BYTES_FLOAT32)
    flags = ("--model-id", tiny_qwen3_dir, *FLOAT32, "--kv-cache-memory", memory)
    launched = launch(
        tmp_path_factory.mktemp("reasoning"),
        *flags,
        "--served-model-name",
        MODEL,
        "--reasoning-parser",
        "qwen3",
    )
    yield launched
    stop(launched)


@pytest.fixture(scope="module")
def raw_text(server: LaunchedServer, tiny_qwen3_dir: str) -> dict[bool, str]:
    """The server's greedy text for the thinking prompt rendered with thinking on and
    off, as `/v1/completions` gives it (prompt token ids, so no special token is added)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    texts = {}
    for thinking in (True, False):
        ids = tokenizer(thinking_prompt(tokenizer, thinking), add_special_tokens=False).input_ids
        body = {"prompt": ids, "max_tokens": THINKING_TOKENS, **GREEDY}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        texts[thinking] = response.json()["choices"][0]["text"]
    return texts


def split_at_close(text: str) -> tuple[str, str]:
    assert "</think>" in text, f"the tiny Qwen3 should close its reasoning: {text!r}"
    reasoning, content = text.split("</think>", 1)
    assert reasoning and content, text
    return reasoning, content


@pytest.fixture(scope="module")
def oai(server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_message_reasoning_is_the_text_before_think_end_and_content_the_rest(
    oai: openai.OpenAI, raw_text: dict[bool, str]
) -> None:
    reasoning, content = split_at_close(raw_text[True])
    response = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=THINKING_TOKENS, **GREEDY
    )
    message = response.choices[0].message.model_dump()
    assert message["reasoning"] == reasoning
    assert message["reasoning_content"] == reasoning
    assert message["content"] == content
    assert message["reasoning"] + "</think>" + message["content"] == raw_text[True]


def test_streamed_chat_deltas_add_up_to_the_same_split(
    oai: openai.OpenAI, raw_text: dict[bool, str]
) -> None:
    reasoning, content = split_at_close(raw_text[True])
    stream = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=THINKING_TOKENS, stream=True, **GREEDY
    )
    got = {"reasoning": "", "reasoning_content": "", "content": ""}
    for chunk in stream:
        if not chunk.choices:
            continue
        delta: dict[str, Any] = chunk.choices[0].delta.model_dump()
        for field in got:
            got[field] += delta.get(field) or ""
    assert got == {"reasoning": reasoning, "reasoning_content": reasoning, "content": content}


def test_enable_thinking_false_in_chat_template_kwargs_answers_without_reasoning(
    oai: openai.OpenAI, raw_text: dict[bool, str]
) -> None:
    response = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=THINKING_TOKENS,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **GREEDY,
    )
    message = response.choices[0].message.model_dump()
    assert message.get("reasoning") is None
    assert message["content"] == raw_text[False]
    assert raw_text[False] != raw_text[True]  # the kwarg changed the prompt


def test_anthropic_thinking_blocks_whole_and_streamed(
    server: LaunchedServer, raw_text: dict[bool, str]
) -> None:
    reasoning, content = split_at_close(raw_text[True])
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": THINKING_TOKENS,
        "messages": MESSAGES,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": GREEDY,
    }
    message = client.messages.create(**ask)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == reasoning
    assert message.content[1].text == content
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    ask["thinking"] = {"type": "disabled"}
    message = client.messages.create(**ask)
    assert [(b.type, b.text) for b in message.content] == [("text", raw_text[False])]


def test_responses_reasoning_item_comes_before_the_message(
    oai: openai.OpenAI, raw_text: dict[bool, str]
) -> None:
    reasoning, content = split_at_close(raw_text[True])
    response = oai.responses.create(
        model=MODEL, input=THINKING_QUESTION, max_output_tokens=THINKING_TOKENS, **GREEDY
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning
    assert response.output_text == content
    # The token limit ends it as `response.incomplete`, which the SDK's final-response
    # helper does not take: the events are read one by one.
    stream = oai.responses.create(
        model=MODEL,
        input=THINKING_QUESTION,
        max_output_tokens=THINKING_TOKENS,
        stream=True,
        **GREEDY,
    )
    events = list(stream)
    deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    for event in events:
        if event.type in deltas:
            deltas[event.type] += event.delta
    assert deltas == {
        "response.reasoning_text.delta": reasoning,
        "response.output_text.delta": content,
    }
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == content

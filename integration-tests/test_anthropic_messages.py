"""Anthropic's Messages API on the embedded SmolLM2 through `cadence launch`, with the real
`anthropic` SDK. The references: the OpenAI chat route (the same conversation renders the
same prompt, so greedy decoding gives the same tokens), the TGI route's token counts, and
each tool's input_schema (jsonschema) for the calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from test_tool_calling import TIME, WEATHER

from conftest import LaunchedServer, launch, stop, tiny_model, together

MODEL = "smollm"
# This SDK's create() has no `temperature` argument: sent as an extra field, as the API takes it.
GREEDY = {"temperature": 0}
SYSTEM = "You are a concise assistant."
ASK = "Explain what a KV cache is in two sentences."
TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather in a city",
        "input_schema": WEATHER,
    },
    {"name": "get_time", "description": "The current time in a timezone", "input_schema": TIME},
]
# The same tools as the OpenAI route takes them.
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": t["name"],
            "description": t["description"],
            "parameters": t["input_schema"],
        },
    }
    for t in TOOLS
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def ant(smollm_server: LaunchedServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=smollm_server.url, api_key="none", max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def tokenizer(smollm_float_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_float_dir)


@pytest.fixture(scope="module")
def oai(smollm_server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="none", timeout=300)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def ask(ant: anthropic.Anthropic, **kwargs) -> anthropic.types.Message:
    return ant.messages.create(
        model=MODEL,
        max_tokens=kwargs.pop("max_tokens", 48),
        system=SYSTEM,
        messages=[{"role": "user", "content": ASK}],
        extra_body=GREEDY,
        **kwargs,
    )


def test_a_greedy_answer_equals_the_chat_route_s_and_usage_counts_its_tokens(
    ant: anthropic.Anthropic, oai: openai.OpenAI, tokenizer
):
    message, reference = together(
        lambda: ask(ant),
        lambda: oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
            max_tokens=48,
            temperature=0,
        ),
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    choice = reference.choices[0]
    assert text_of(message) == choice.message.content
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice.finish_reason]
    assert message.stop_sequence is None
    assert message.usage.input_tokens == reference.usage.prompt_tokens
    assert message.usage.output_tokens == reference.usage.completion_tokens
    # transformers' rendering of the same conversation, tokenized
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert message.usage.input_tokens == len(prompt)
    # the SDK's token counter agrees with usage
    counted = ant.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": ASK}]
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_max_tokens_and_stop_sequences_end_the_answer(ant: anthropic.Anthropic):
    full = ask(ant)
    short = ask(ant, max_tokens=3)
    assert short.stop_reason == "max_tokens"
    assert short.usage.output_tokens == 3
    assert text_of(full).startswith(text_of(short))
    words = text_of(full).split()
    assert len(words) > 4, text_of(full)
    stop = words[3]
    stopped = ask(ant, stop_sequences=["never-in-this-text-#", stop])
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == stop
    assert text_of(stopped) == text_of(full)[: text_of(full).index(stop)]


def streamed(ant: anthropic.Anthropic, **kwargs) -> tuple[str, anthropic.types.Message, list[str]]:
    with ant.messages.stream(model=MODEL, extra_body=GREEDY, **kwargs) as stream:
        names = []
        text = ""
        for event in stream:
            names.append(event.type)
            if event.type == "text":
                text += event.text
        final = stream.get_final_message()
    return text, final, names


def without_ids(message: anthropic.types.Message) -> dict:
    body = message.model_dump(exclude_none=True)
    body.pop("id")
    for block in body["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return body


def test_a_streamed_answer_adds_up_to_the_non_streamed_one(ant: anthropic.Anthropic):
    whole, (text, final, names) = together(
        lambda: ask(ant),
        lambda: streamed(
            ant, max_tokens=48, system=SYSTEM, messages=[{"role": "user", "content": ASK}]
        ),
    )
    assert text == text_of(whole)
    assert without_ids(final) == without_ids(whole)
    assert names[0] == "message_start" and names[-1] == "message_stop"


def call(ant: anthropic.Anthropic, **kwargs) -> anthropic.types.Message:
    return ant.messages.create(
        model=MODEL,
        max_tokens=kwargs.pop("max_tokens", 200),
        messages=kwargs.pop("messages", TOOL_ASK),
        tools=TOOLS,
        extra_body=GREEDY,
        **kwargs,
    )


def tool_uses(message: anthropic.types.Message) -> list[tuple[str, dict]]:
    out = []
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_")
            assert isinstance(block.input, dict)
            jsonschema.validate(block.input, SCHEMAS[block.name])
            out.append((block.name, block.input))
    return out


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "tool", "name": "get_time"},
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "auto"},
    ],
)
def test_tool_use_blocks_validate_and_stream_the_same(ant: anthropic.Anthropic, choice: dict):
    message, (_, final, names) = together(
        lambda: call(ant, tool_choice=choice),
        lambda: streamed(ant, max_tokens=200, messages=TOOL_ASK, tools=TOOLS, tool_choice=choice),
    )
    uses = tool_uses(message)
    if choice["type"] == "auto" and not uses:
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert "<tool_call>" not in text_of(message)
    else:
        assert len(uses) == 1
        assert message.stop_reason == "tool_use"
    if choice["type"] == "tool":
        assert [name for name, _ in uses] == ["get_time"]
    assert without_ids(final) == without_ids(message)
    if uses:
        assert "input_json" in names


def test_a_conversation_with_a_tool_result_answers_as_the_chat_route(
    ant: anthropic.Anthropic, oai: openai.OpenAI
):
    first = call(ant, tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [block for block in first.content if block.type == "tool_use"]
    result = '{"temperature": 21}'
    history = [
        *TOOL_ASK,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}],
        },
    ]
    answer = call(ant, messages=history, tool_choice={"type": "none"}, max_tokens=40)
    assert tool_uses(answer) == []
    openai_history = [
        *TOOL_ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(use.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": result},
    ]
    reference = oai.chat.completions.create(
        model=MODEL,
        messages=openai_history,
        tools=OPENAI_TOOLS,
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    assert text_of(answer) == reference.choices[0].message.content
    assert answer.usage.input_tokens == reference.usage.prompt_tokens
    counted = ant.messages.count_tokens(
        model=MODEL, messages=history, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert counted.input_tokens == answer.usage.input_tokens


def test_bad_requests_are_400s_naming_the_field(ant: anthropic.Anthropic):
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    with pytest.raises(anthropic.BadRequestError) as error:
        # the SDK's create() insists on max_tokens: its raw post sends a body without it
        ant.post(
            "/v1/messages",
            cast_to=object,
            body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert error.value.body["error"]["type"] == "invalid_request_error"
    assert error.value.body["error"]["message"].startswith("max_tokens")
    cases = [
        ([{"role": "system", "content": "hi"}], "messages[0].role"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}],
            "messages[0].content[1].type",
        ),
    ]
    for messages, field in cases:
        with pytest.raises(anthropic.BadRequestError) as error:
            ant.messages.create(model=MODEL, max_tokens=5, messages=messages)
        assert error.value.body["type"] == "error"
        assert error.value.body["error"]["type"] == "invalid_request_error"
        assert error.value.body["error"]["message"].startswith(field), error.value.body
    with pytest.raises(anthropic.BadRequestError) as error:
        ant.messages.create(
            model=MODEL, max_tokens=5, messages=TOOL_ASK, extra_body={"temperature": 1.5}
        )
    assert error.value.body["error"]["message"].startswith("temperature")


KEY = "anthropic-test-key"


@pytest.fixture(scope="module")
def keyed_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """The tiny random Llama: the key is the point, not the model."""
    tmp: Path = tmp_path_factory.mktemp("anthropic-keys")
    server = launch(
        tmp, *tiny_model(tiny_llama_dir, 64), "--api-key", KEY, "--served-model-name", MODEL
    )
    yield server
    assert stop(server) == 0, server.log()


def test_the_sdk_s_x_api_key_opens_the_routes_and_a_wrong_key_is_a_401(
    keyed_server: LaunchedServer,
):
    keyed = anthropic.Anthropic(base_url=keyed_server.url, api_key=KEY, max_retries=0, timeout=300)
    message = keyed.messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.usage.output_tokens >= 1
    counted = keyed.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens == message.usage.input_tokens
    wrong = anthropic.Anthropic(base_url=keyed_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as error:
        wrong.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert error.value.status_code == 401
    assert error.value.body["error"]["type"] == "authentication_error"

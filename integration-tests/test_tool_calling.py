"""OpenAI tool calling on the embedded SmolLM2 through `cadence launch`, with the real
`openai` client: auto with two tools, required, a named tool, parallel calls, streamed
and not; every call's arguments validate against its tool's schema, and under greedy
decoding the streamed calls equal the non-streamed ones."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import LaunchedServer, together

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone",
            "parameters": TIME,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def oai(smollm_server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="none")


def create(oai: openai.OpenAI, **kwargs):
    return oai.chat.completions.create(
        model="smollm",
        messages=kwargs.pop("messages", ASK),
        tools=TOOLS,
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", 200),
        **kwargs,
    )


def check_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(oai: openai.OpenAI, **kwargs) -> tuple[str, list[dict], str]:
    """Content, calls (by index: id, name, concatenated arguments) and finish reason put
    together from the chunks, checking OpenAI's delta shapes on the way."""
    content, calls, finish = "", {}, None
    for chunk in create(oai, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                # the first delta of a call: index, id, type, name and empty arguments
                assert call.id and call.type == "function" and call.function.name
                assert call.function.arguments == ""
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def answered_and_streamed(oai: openai.OpenAI, **kwargs):
    """`create`'s answer and `streamed`'s, the two requests sent together."""
    return together(lambda: create(oai, **kwargs), lambda: streamed(oai, **kwargs))


def same_as_streamed(answer, stream) -> None:
    content, calls, finish = stream
    message = answer.choices[0].message
    assert finish == answer.choices[0].finish_reason
    assert content == (message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]


def test_required_parallel_calls_validate_and_stream_the_same(oai: openai.OpenAI):
    answer, stream = answered_and_streamed(oai, tool_choice="required")
    choice = answer.choices[0]
    calls = check_calls(choice.message.tool_calls)
    # the 135M model asks for both tools, then goes on calling until max_tokens cuts an
    # unfinished call, which comes back as content, never as a call
    assert {name for name, _ in calls} == {"get_weather", "get_time"}
    if choice.finish_reason == "length":
        assert choice.message.content.lstrip().startswith("<tool_call>")
    else:
        assert choice.finish_reason == "tool_calls"
    same_as_streamed(answer, stream)


def test_a_named_tool_is_called_once_and_finishes_with_stop(oai: openai.OpenAI):
    named = {"type": "function", "function": {"name": "get_time"}}
    answer, stream = answered_and_streamed(oai, tool_choice=named)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI's, for a named tool
    calls = check_calls(choice.message.tool_calls)
    assert [name for name, _ in calls] == ["get_time"]
    same_as_streamed(answer, stream)


def test_parallel_tool_calls_false_allows_exactly_one(oai: openai.OpenAI):
    answer, stream = answered_and_streamed(oai, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(answer.choices[0].message.tool_calls)) == 1
    assert answer.choices[0].finish_reason == "tool_calls"
    same_as_streamed(answer, stream)


def test_auto_with_two_tools_answers_in_text_or_valid_calls(oai: openai.OpenAI):
    asks = [
        ASK,
        [{"role": "user", "content": "What is the weather like in Berlin in celsius?"}],
        [{"role": "user", "content": "Say hello to me."}],
    ]
    answers = together(
        *(lambda m=m: answered_and_streamed(oai, messages=m, tool_choice="auto") for m in asks)
    )
    for answer, stream in answers:
        choice = answer.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert "<tool_call>" not in (choice.message.content or "")
        same_as_streamed(answer, stream)


def test_a_tool_result_in_history_is_answered(oai: openai.OpenAI):
    first = create(oai, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = create(oai, messages=history, tool_choice="none", max_tokens=40)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


def test_bad_tool_fields_are_400s_naming_them(oai: openai.OpenAI):
    bad_tools = [{"type": "function", "function": {"name": "bad name!"}}]
    cases = [
        ({"tools": bad_tools}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
    ]
    for extra, field in cases:
        with pytest.raises(openai.BadRequestError) as error:
            oai.chat.completions.create(model="smollm", messages=ASK, max_tokens=5, **extra)
        assert error.value.body["param"] == field, error.value.body

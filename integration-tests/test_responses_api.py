"""OpenAI's Responses API on the embedded SmolLM2 through `cadence launch`, with the real
`openai` client. The reference is `/v1/chat/completions` on the same conversation: under
greedy decoding the Responses answer (text, calls, usage) equals it, streamed
(`client.responses.stream`) equals non-streamed, `previous_response_id` equals sending
the whole history, and bad fields are 400s naming them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from test_tool_calling import ASK, SCHEMAS, TOOLS

from conftest import LaunchedServer, together

# The chat tools in the Responses API's flat shape.
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
QUESTION = ASK[0]["content"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(smollm_server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="none")


def respond(oai: openai.OpenAI, **kwargs: Any):
    kwargs.setdefault("max_output_tokens", 40)
    return oai.responses.create(model="smollm", temperature=0, **kwargs)


def chat(oai: openai.OpenAI, messages: list[dict], max_tokens: int = 40, **kwargs: Any):
    return oai.chat.completions.create(
        model="smollm", messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )


def calls_of(response) -> list[tuple[str, str]]:
    """(name, arguments) of each function_call item, its shape checked."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            assert item.id.startswith("fc_") and item.call_id.startswith("call_")
            assert item.status == "completed"
            jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
            out.append((item.name, item.arguments))
    return out


def streamed(oai: openai.OpenAI, **kwargs: Any):
    """The final response `client.responses.stream` puts together, the events checked:
    created and in_progress first, completed (or incomplete) last, sequence numbers in
    order. The SDK gives a final response only after `response.completed`; an
    incomplete one is the last event's."""
    kwargs.setdefault("max_output_tokens", 40)
    with oai.responses.stream(model="smollm", temperature=0, **kwargs) as stream:
        events = list(stream)
        if events[-1].type == "response.incomplete":
            final = events[-1].response
        else:
            final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    return final


def same_answer(a, b) -> None:
    assert a.output_text == b.output_text
    assert [i.type for i in a.output] == [i.type for i in b.output]
    assert [(c.name, c.arguments) for c in a.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in b.output if c.type == "function_call"
    ]
    assert a.usage.input_tokens == b.usage.input_tokens
    assert a.usage.output_tokens == b.usage.output_tokens
    assert a.status == b.status


def test_greedy_text_and_usage_equal_chat_completions(oai: openai.OpenAI):
    r = respond(oai, input="Name three colors.", instructions="Be brief.", max_output_tokens=30)
    c = chat(
        oai,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three colors."},
        ],
        max_tokens=30,
    )
    assert r.id.startswith("resp_") and r.object == "response"
    [message] = r.output
    assert (
        message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    )
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == c.usage.total_tokens
    assert r.status == ("completed" if c.choices[0].finish_reason == "stop" else "incomplete")
    assert (r.instructions, r.max_output_tokens, r.temperature) == ("Be brief.", 30, 0)
    # a developer message is a system message, as instructions are
    developer = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]},
    ]
    same_answer(respond(oai, input=developer, max_output_tokens=30), r)


def test_max_output_tokens_cuts_the_answer_as_incomplete(oai: openai.OpenAI):
    ask = "Write a long story about a dragon."
    r = respond(oai, input=ask, max_output_tokens=5)
    c = chat(oai, [{"role": "user", "content": ask}], max_tokens=5)
    assert c.choices[0].finish_reason == "length"
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert r.output_text == c.choices[0].message.content


def test_streamed_text_equals_non_streamed(oai: openai.OpenAI):
    kwargs = {"input": "Name three colors.", "instructions": "Be brief.", "max_output_tokens": 30}
    same_answer(streamed(oai, **kwargs), respond(oai, **kwargs))


@pytest.mark.parametrize(
    "tool_choice",
    ["required", "auto", {"type": "function", "name": "get_time"}],
    ids=["required", "auto", "named"],
)
def test_function_calls_validate_equal_chat_s_and_stream_the_same(oai: openai.OpenAI, tool_choice):
    chat_choice = tool_choice
    if isinstance(tool_choice, dict):
        chat_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    asked = {"input": QUESTION, "tools": FLAT_TOOLS, "tool_choice": tool_choice}
    r, c, s = together(
        lambda: respond(oai, **asked, max_output_tokens=200),
        lambda: chat(oai, ASK, max_tokens=200, tools=TOOLS, tool_choice=chat_choice),
        lambda: streamed(oai, **asked, max_output_tokens=200),
    )
    message = c.choices[0].message
    assert calls_of(r) == [
        (t.function.name, t.function.arguments) for t in message.tool_calls or []
    ]
    assert r.output_text == (message.content or "")
    assert r.usage.output_tokens == c.usage.completion_tokens
    if tool_choice != "auto":
        assert calls_of(r)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls_of(r)] == ["get_time"]
    same_answer(s, r)


def test_a_function_call_output_is_answered_and_previous_response_id_continues(
    oai: openai.OpenAI,
):
    first = respond(
        oai,
        input=QUESTION,
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"temperature": 21}',
    }
    call_item = {
        "type": "function_call",
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments,
    }
    whole = respond(
        oai,
        input=[{"role": "user", "content": QUESTION}, call_item, result],
        tools=FLAT_TOOLS,
        tool_choice="none",
    )
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'},
    ]
    c = chat(oai, history, tools=TOOLS, tool_choice="none")
    assert whole.output_text == c.choices[0].message.content
    assert whole.usage.input_tokens == c.usage.prompt_tokens
    follow = respond(
        oai, previous_response_id=first.id, input=[result], tools=FLAT_TOOLS, tool_choice="none"
    )
    same_answer(follow, whole)
    assert follow.previous_response_id == first.id


def test_previous_response_id_equals_sending_the_whole_history(oai: openai.OpenAI):
    first = respond(oai, input="My name is Ada. Say hello to me.", max_output_tokens=20)
    follow = respond(
        oai, previous_response_id=first.id, input="What is my name?", max_output_tokens=20
    )
    whole = respond(
        oai,
        input=[
            {"role": "user", "content": "My name is Ada. Say hello to me."},
            {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
            {"role": "user", "content": "What is my name?"},
        ],
        max_output_tokens=20,
    )
    same_answer(follow, whole)
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_get_returns_a_stored_response_and_404s_otherwise(oai: openai.OpenAI):
    r = respond(oai, input="Say hi.", max_output_tokens=10, metadata={"run": "1"})
    got = oai.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    assert got.metadata == {"run": "1"}
    unstored = respond(oai, input="Say hi.", max_output_tokens=10, store=False)
    assert unstored.store is False
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as error:
            oai.responses.retrieve(missing)
        assert error.value.status_code == 404
        assert error.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as error:
        respond(oai, previous_response_id=unstored.id, input="Again.")
    assert error.value.body["param"] == "previous_response_id"


def test_text_format_json_schema_validates_and_equals_chat_s_response_format(oai: openai.OpenAI):
    ask = "Give a person's name and age as JSON."
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = respond(oai, input=ask, text={"format": fmt}, max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    c = chat(
        oai,
        [{"role": "user", "content": ask}],
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert r.output_text == c.choices[0].message.content
    assert r.text.format.type == "json_schema"


def test_bad_fields_are_400s_naming_them(oai: openai.OpenAI):
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    cases = [
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, image]}]},
            "input[0].content[1]",
        ),
        # (`reasoning` items, given back from an earlier answer, are accepted and left out)
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {
                "input": "hi",
                "tools": FLAT_TOOLS,
                "tool_choice": {"type": "function", "name": "nope"},
            },
            "tool_choice.name",
        ),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "hi", "temperature": 5}, "temperature"),
        (
            {"input": "hi", "tools": FLAT_TOOLS, "text": {"format": {"type": "json_object"}}},
            "text.format",
        ),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as error:
            oai.responses.create(model="smollm", max_output_tokens=5, **kwargs)
        assert error.value.body["param"] == field, error.value.body
        assert field in error.value.body["message"]

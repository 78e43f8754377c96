"""Structured outputs through `cadence launch`: JSON schemas, regular expressions and
choices with the real clients (openai, text-generation), checked against transformers +
llguidance's masks as the reference, with and without fast-forward, and a bad or
pathological grammar failing only its own request.

The masks, fast-forward, sampled outputs and refusals are checked on the tiny random
Llama (SmolLM2's tokenizer, so the same vocabulary under the same grammars; a step costs a
fraction of SmolLM2's); the clients' round trips (a pydantic model parsed by the OpenAI
SDK, TGI's client) on the embedded SmolLM2, whose answers end by themselves where a
schema leaves a string's length open."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pydantic
import pytest
from constrained_reference import (
    ConstrainedReference,
    choice_grammar,
    json_grammar,
    regex_grammar,
)

from conftest import LaunchedServer, launch, stop, tiny_model, together

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "nickname": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
COLORS = ["red", "green", "blue", "dark purple"]
PROMPTS = [
    "Describe a fictional person as JSON.",
    "Give me a phone number.",
    "Pick a color.",
]


TINY = "tiny"  # the tiny servers' model name
TINY_BLOCKS = 1024


@pytest.fixture(scope="module")
def tiny_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """The tiny Llama, fast-forwarding the tokens a grammar forces (the default)."""
    server = launch(
        tmp_path_factory.mktemp("ff"),
        *tiny_model(tiny_llama_dir, TINY_BLOCKS),
        *("--served-model-name", TINY),
    )
    yield server
    assert stop(server) == 0, server.log()


@pytest.fixture(scope="module")
def server_no_ff(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str
) -> Iterator[LaunchedServer]:
    """The same model with every constrained token sampled (no fast-forward)."""
    server = launch(
        tmp_path_factory.mktemp("no-ff"),
        *tiny_model(tiny_llama_dir, TINY_BLOCKS),
        "--no-grammar-fast-forward",
        *("--served-model-name", TINY),
    )
    yield server
    assert stop(server) == 0, server.log()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> ConstrainedReference:
    return ConstrainedReference(tiny_llama_dir)


def chat_text(reference: ConstrainedReference, prompt: str) -> str:
    return reference.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


CASES = [
    ("json", PERSON, json_grammar(PERSON)),
    ("regex", PHONE, regex_grammar(PHONE)),
]


def tgi_generate(url: str, text: str, kind: str, value: object, max_new_tokens: int) -> dict:
    response = httpx.post(
        f"{url}/generate",
        json={
            "inputs": text,
            "parameters": {
                "max_new_tokens": max_new_tokens,
                "details": True,
                "grammar": {"type": kind, "value": value},
            },
        },
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("kind,value,grammar", CASES, ids=[c[0] for c in CASES])
def test_greedy_constrained_tokens_equal_transformers_under_the_same_masks(
    server_no_ff: LaunchedServer, reference: ConstrainedReference, kind, value, grammar
):
    texts = [chat_text(reference, prompt) for prompt in PROMPTS]
    # the server decodes the three at once (it is batch-invariant), then the reference
    # runs: on a 2-core machine two torch thread teams at once are slower than one after
    # the other (each spins at its barriers while the other holds a core)
    served = together(
        *(lambda t=t: tgi_generate(server_no_ff.url, t, kind, value, 120) for t in texts)
    )
    for prompt, text, got in zip(PROMPTS, texts, served, strict=True):
        prompt_ids = reference.tokenizer(text, add_special_tokens=False).input_ids
        want = reference.greedy(prompt_ids, grammar, 120)
        got_ids = [t["id"] for t in got["details"]["tokens"]]
        decoded = reference.tokenizer.decode(want)
        assert got_ids == want, (prompt, decoded, got["generated_text"])


def test_a_choice_is_the_reference_s_greedy_choice(
    server_no_ff: LaunchedServer, reference: ConstrainedReference
):
    oai = openai.OpenAI(base_url=f"{server_no_ff.url}/v1", api_key="none")
    for prompt in PROMPTS:
        text = chat_text(reference, prompt)
        prompt_ids = reference.tokenizer(text, add_special_tokens=False).input_ids
        want = reference.greedy(prompt_ids, choice_grammar(COLORS), 16)
        answer = oai.completions.create(
            model=TINY,
            prompt=text,
            max_tokens=16,
            temperature=0,
            extra_body={"guided_choice": COLORS},
        )
        assert answer.choices[0].text == reference.tokenizer.decode(want, skip_special_tokens=True)
        assert answer.choices[0].text in COLORS


@pytest.mark.parametrize("kind,value,grammar", CASES, ids=[c[0] for c in CASES])
def test_fast_forward_saves_steps_and_keeps_the_greedy_text(
    tiny_server: LaunchedServer, server_no_ff: LaunchedServer, reference, kind, value, grammar
):
    before = forwarded(tiny_server.url)
    texts = [chat_text(reference, prompt) for prompt in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:  # one batch per server
        fast = list(pool.map(lambda t: tgi_generate(tiny_server.url, t, kind, value, 120), texts))
        slow = list(pool.map(lambda t: tgi_generate(server_no_ff.url, t, kind, value, 120), texts))
    for prompt, one, other in zip(PROMPTS, fast, slow, strict=True):
        assert one["generated_text"] == other["generated_text"], prompt
    assert forwarded(tiny_server.url) > before


def forwarded(url: str) -> int:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r"^cadence_grammar_fast_forward_tokens_total\{[^}]*\} (\d+)$", metrics, re.M)
    assert match, metrics
    return int(match.group(1))


@pytest.fixture(scope="module")
def oai(smollm_server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="none")


@pytest.fixture(scope="module")
def tiny_oai(tiny_server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none")


class Event(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    day: int = pydantic.Field(ge=1, le=31)
    participants: list[str] = pydantic.Field(max_length=3)


def test_the_openai_sdk_parses_a_pydantic_model(oai: openai.OpenAI):
    completion = oai.chat.completions.parse(
        model="smollm",
        messages=[{"role": "user", "content": "Alice and Bob meet for lunch on the 3rd."}],
        response_format=Event,
        max_tokens=200,
        temperature=0,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Event), message.content
    assert completion.choices[0].finish_reason == "stop"


def test_fifty_seeded_sampled_requests_all_validate(tiny_oai: openai.OpenAI):
    def one(seed: int) -> tuple[str, str]:
        answer = tiny_oai.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        return answer.choices[0].message.content, answer.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(50)))
    for content, finish_reason in answers:
        assert finish_reason == "stop", content
        jsonschema.validate(json.loads(content), PERSON)
    assert len({content for content, _ in answers}) > 10, "seeds give different people"


def test_regex_choice_and_json_object_outputs_match(tiny_oai: openai.OpenAI):
    messages = [{"role": "user", "content": "Call me."}]
    for seed in range(5):
        phone = (
            tiny_oai.chat.completions.create(
                model=TINY,
                messages=messages,
                temperature=1.0,
                seed=seed,
                max_tokens=30,
                extra_body={"guided_regex": PHONE},
            )
            .choices[0]
            .message.content
        )
        assert re.fullmatch(PHONE, phone), phone
        color = (
            tiny_oai.completions.create(
                model=TINY,
                prompt="My favourite color is",
                temperature=1.0,
                seed=seed,
                max_tokens=10,
                extra_body={"structured_outputs": {"choice": COLORS}},
            )
            .choices[0]
            .text
        )
        assert color in COLORS
    anything = tiny_oai.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "A JSON object please."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    ).choices[0]
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert anything.message.content.startswith("{")


def test_the_text_generation_client_grammar_parameter(smollm_server: LaunchedServer):
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    client = Client(smollm_server.url, timeout=300)
    answer = client.generate(
        "Describe a person as JSON:",
        max_new_tokens=300,
        grammar=Grammar(type=GrammarType.Json, value=PERSON),
    )
    jsonschema.validate(json.loads(answer.generated_text), PERSON)
    answer = client.generate(
        "Phone:", max_new_tokens=30, grammar=Grammar(type=GrammarType.Regex, value=PHONE)
    )
    assert re.fullmatch(PHONE, answer.generated_text)


def test_bad_and_pathological_grammars_fail_alone_while_others_stream(
    tiny_server: LaunchedServer, tiny_oai: openai.OpenAI
):
    streamed: list[str] = []

    def stream() -> None:
        for chunk in tiny_oai.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                streamed.append(chunk.choices[0].delta.content)

    streamer = threading.Thread(target=stream)
    streamer.start()
    deep: dict = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    # past llguidance's grammar size limit ("schema too large")
    huge = {
        "anyOf": [
            {"type": "object", "properties": {f"k{j}": {"type": "integer"} for j in range(50)}}
            for _ in range(400)
        ]
    }
    cases = [
        ({"type": "object", "properties": {"a": {"type": "no-such-type"}}}, "response_format"),
        ({"type": "string", "pattern": "(unclosed"}, "response_format"),
        (deep, "response_format"),
        (huge, "response_format"),
    ]
    for schema, field in cases:
        with pytest.raises(openai.BadRequestError) as error:
            tiny_oai.chat.completions.create(
                model=TINY,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=20,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            )
        # (the deepest schema is refused while the body is read, naming its path)
        assert error.value.body["param"].startswith(field), error.value.body
        assert len(error.value.body["message"]) > len(field) + 2
    tgi = httpx.post(
        f"{tiny_server.url}/generate",
        json={"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "(a"}}},
        timeout=60,
    )
    assert tgi.status_code == 422 and "parameters.grammar" in tgi.json()["error"], tgi.text
    streamer.join(timeout=300)
    assert len("".join(streamed)) > 100, "the stream went on while grammars failed"

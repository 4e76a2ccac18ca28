"""Structured outputs (`response_format`, `structured_outputs`) enforced by llguidance's token masks:

- 100 generations (sampled, seeded) against 10 JSON schemas of the kinds agents send (nested
  objects, enums, bounded arrays, `anyOf`, bounded strings and integers) all parse and validate
  with `jsonschema`, though the tiny model is random;
- `choice` and `regex` outputs are one of the choices / match the regex;
- greedy constrained decoding with n-gram speculation equals it without;
- through the server and the official `openai` client: `response_format` json_schema and
  json_object, vLLM's `structured_outputs`; a schema that cannot be enforced is a 400.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from aviatorc.runtime import Session
from aviatorc.runtime.text import load_tokenizer
from aviatorc.serve.engine import Engine, GenerationRequest
from aviatorc.serve.speculative import DraftModel, NgramDrafts, Speculator
from aviatorc.serve.structured import Grammars
from tests.serve.servers import EOS, start_server
from tests.serve.test_engine import serve

openai = pytest.importorskip("openai")
VOCAB = 128

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                                          "maximum": 99}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": NAME, "age": {
        "type": "integer", "minimum": 1, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "boolean"}, {"enum": ["none", "all"]}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"call": {"enum": ["get_weather", "get_time"]}, "args": {
        "type": "object", "properties": {"city": NAME}, "required": ["city"], "additionalProperties": False}},
     "required": ["call", "args"], "additionalProperties": False},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "maxItems": 5}, "done": {"type": "boolean"}},
     "required": ["ids", "done"], "additionalProperties": False},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": [1, 2, 3]}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def target(artifacts) -> Session:
    return Session(artifacts["llama"])


@pytest.fixture(scope="module")
def grammars(char_tokenizer_dir) -> Grammars:
    return Grammars(load_tokenizer(char_tokenizer_dir), VOCAB)


def text_of(tokenizer, request: GenerationRequest) -> str:
    return tokenizer.decode([t for t in request.generated if t != EOS], skip_special_tokens=True)


def test_a_hundred_sampled_generations_against_ten_schemas_all_validate(target, grammars, char_tokenizer_dir):
    tok = load_tokenizer(char_tokenizer_dir)
    reqs = [GenerationRequest(prompt=[10 + i, 20 + s], max_tokens=160, temperature=1.0, seed=100 * s + i,
                              stop_ids=frozenset({EOS}), constraint=grammars.constraint("json_schema", schema))
            for s, schema in enumerate(SCHEMAS) for i in range(10)]
    asyncio.run(serve(Engine(target), reqs))
    outputs = set()
    for request, schema in zip(reqs, [s for s in SCHEMAS for _ in range(10)]):
        assert request.finished is not None and request.finished.reason == "stop", (request.finished, text_of(tok, request))
        text = text_of(tok, request)
        jsonschema.validate(json.loads(text), schema)
        outputs.add(text)
    assert len(outputs) > 30  # sampled: the grammar leaves the model real choices


def test_choice_and_regex_outputs_are_what_was_asked(target, grammars, char_tokenizer_dir):
    tok = load_tokenizer(char_tokenizer_dir)
    choices = ["alpha", "beta", "gamma delta"]
    picks = [GenerationRequest(prompt=[30 + i], max_tokens=40, temperature=1.0, seed=i,
                               constraint=grammars.constraint("choice", choices)) for i in range(6)]
    dates = [GenerationRequest(prompt=[40 + i], max_tokens=40, temperature=1.0, seed=i,
                               constraint=grammars.constraint("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"))
             for i in range(6)]
    asyncio.run(serve(Engine(target), picks + dates))
    assert all(text_of(tok, r) in choices for r in picks)
    assert all(re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", text_of(tok, r)) for r in dates)
    assert len({text_of(tok, r) for r in picks}) > 1


def test_constrained_greedy_decoding_with_ngram_speculation_equals_it_without(target, grammars):
    schema = {"type": "array", "items": {"enum": ["ab", "abc", "b"]}, "minItems": 6, "maxItems": 8}

    def run(speculator: Speculator | None) -> list[GenerationRequest]:
        reqs = [GenerationRequest(prompt=p, max_tokens=80, constraint=grammars.constraint("json_schema", schema))
                for p in ([50, 51], [60, 61, 62])]
        asyncio.run(serve(Engine(target, speculator=speculator), reqs))
        return reqs

    plain = run(None)
    speculator = Speculator(target, NgramDrafts(), 4)
    drafted = run(speculator)
    assert [r.generated for r in drafted] == [r.generated for r in plain]
    assert all(r.finished.reason == "stop" for r in drafted)
    assert speculator.proposed > 0  # repeated items: the lookup proposes, the grammar cuts what it refuses

    # The target drafting for itself: every draft the grammar lets through is the target's masked
    # choice, so all are accepted, provided the draft's cache follows the cuts the grammar makes.
    def spell(speculator: Speculator | None) -> list[list[int]]:
        reqs = [GenerationRequest(prompt=p, max_tokens=40, constraint=grammars.constraint("regex", "[ -z]{30}"))
                for p in ([50, 51], [60, 61, 62], [70])]
        asyncio.run(serve(Engine(target, speculator=speculator), reqs))
        return [r.generated for r in reqs]

    itself = Speculator(target, DraftModel(Session(target.artifact.path), target), 4)
    assert spell(itself) == spell(None)
    assert 0 < itself.accepted == itself.proposed


@pytest.fixture(scope="module")
def server(artifacts, char_tokenizer_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with start_server(str(artifacts["llama"]), "--tokenizer", str(char_tokenizer_dir), log=log) as running:
        yield running


def test_the_openai_clients_response_format_and_vllms_structured_outputs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    schema = SCHEMAS[3]
    out = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "who?"}], max_tokens=120, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}], max_tokens=12,
                                              response_format={"type": "json_object"}, seed=2)
    assert anything.choices[0].message.content.startswith("{")
    picked = client.completions.create(model="llama", prompt="pick:", max_tokens=20, seed=3,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert picked.choices[0].text in ("left", "right")


def test_a_structure_that_cannot_be_enforced_is_a_400(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.chat.completions.create(model="llama", messages=messages, max_tokens=4,
                                       extra_body={"structured_outputs": {"regex": "(unclosed"}})
    with pytest.raises(openai.BadRequestError, match="exactly one"):
        client.chat.completions.create(model="llama", messages=messages, max_tokens=4,
                                       extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model="llama", messages=messages, max_tokens=4,
                                       response_format={"type": "json_schema"})
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):  # completions have no tools
        client.completions.create(model="llama", prompt="x", max_tokens=4, extra_body={"tools": [WEATHER]})


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"], "additionalProperties": False}}}


def test_tool_calls_named_required_and_auto_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "weather?"}]
    named = client.chat.completions.create(model="llama", messages=messages, max_tokens=80, seed=4, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (named_call,) = choice.message.tool_calls
    assert named_call.type == "function" and named_call.function.name == "get_weather"
    assert named_call.id.startswith("call_")
    jsonschema.validate(json.loads(named_call.function.arguments), WEATHER["function"]["parameters"])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        required = client.chat.completions.create(model="llama", messages=messages, max_tokens=200, seed=seed,
                                                  tools=[WEATHER, TIME], tool_choice="required")
        calls = required.choices[0].message.tool_calls
        assert calls and required.choices[0].finish_reason == "tool_calls"
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # auto: a JSON call in the answer is a tool call (forced here with a schema); plain text stays text
    as_call = {"type": "object", "properties": {"name": {"enum": ["get_time"]}, "parameters": TIME["function"]["parameters"]},
               "required": ["name", "parameters"], "additionalProperties": False}
    auto = client.chat.completions.create(model="llama", messages=messages, max_tokens=60, tools=[WEATHER, TIME],
                                          extra_body={"structured_outputs": {"json": as_call}})
    assert auto.choices[0].message.tool_calls[0].function.name == "get_time"
    # auto reads the forms other chat templates teach: Hermes / Qwen blocks, Mistral's [TOOL_CALLS]
    hermes = ('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>')
    mistral = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "local"}}]'
    for written, want in ((hermes, [("get_time", {"zone": "utc"}), ("get_weather", {"city": "Oslo", "unit": "c"})]),
                          (mistral, [("get_time", {"zone": "local"})])):
        forced = client.chat.completions.create(model="llama", messages=messages, max_tokens=200, tools=[WEATHER, TIME],
                                                extra_body={"structured_outputs": {"regex": re.escape(written)}})
        calls = forced.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls or ()] == want, forced
    text = client.chat.completions.create(model="llama", messages=messages, max_tokens=20, tools=[WEATHER, TIME],
                                          extra_body={"structured_outputs": {"choice": ["sunny", "rain"]}})
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content in ("sunny", "rain")
    # streamed: the call comes whole in the last chunk, with its index
    stream = client.chat.completions.create(model="llama", messages=messages, max_tokens=80, seed=4, stream=True,
                                            tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = [c for c in stream if c.choices]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls" and last.delta.tool_calls[0].index == 0
    assert last.delta.tool_calls[0].function.arguments == named_call.function.arguments  # same seed, same call
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="llama", messages=messages, max_tokens=4, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})

"""Structured output through llguidance on the demo checkpoint: response_format json_object /
json_schema, vLLM's guided_choice / guided_regex, tool_choice "required" and named; the mask
is applied inside the step (other rows of the batch untouched), also with overlap scheduling."""
from __future__ import annotations

import json
import re

import pytest


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a person as JSON"}]


def _matches(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "ok"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 12
            and isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
            and 0 <= obj["age"] <= 150 and isinstance(obj["ok"], bool))


def test_json_schema_output_parses_and_matches_the_schema(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in range(4):
        r = served.post("/v1/chat/completions", {"messages": ASK, "response_format": fmt,
                                                 "max_tokens": 80, "seed": seed})
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", c
        assert _matches(json.loads(c["message"]["content"])), c["message"]["content"]


def test_streamed_json_schema_output_parses_too(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    stream = served.client().chat.completions.create(
        model=served.model, messages=ASK, response_format=fmt, max_tokens=80, stream=True,
        seed=5)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert _matches(json.loads(text))


def test_json_object_output_is_an_object(served):
    r = served.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 60, "seed": 1,
                                             "response_format": {"type": "json_object"},
                                             "temperature": 0})
    c = r.json()["choices"][0]
    if c["finish_reason"] == "stop":           # an open-ended object may not close in 60 tokens
        assert isinstance(json.loads(c["message"]["content"]), dict)
    assert c["message"]["content"].startswith("{")


def test_guided_choice_and_regex(served):
    for seed in range(3):
        r = served.post("/v1/completions", {"prompt": "The answer is", "max_tokens": 10,
                                            "seed": seed, "guided_choice": ["yes", "no",
                                                                            "maybe later"]})
        assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe later")
        r = served.post("/v1/completions", {"prompt": "The code is", "max_tokens": 12,
                                            "seed": seed, "guided_regex": r"[A-F]{3}-\d{2}"})
        assert re.fullmatch(r"[A-F]{3}-\d{2}", r.json()["choices"][0]["text"])


def test_guided_rows_leave_the_rest_of_the_batch_untouched(served):
    plain = {"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0}
    want = served.post("/v1/completions", plain).json()["choices"][0]["text"]
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(4) as pool:
        guided = [pool.submit(served.post, "/v1/completions",
                              {"prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{8}"})
                  for _ in range(3)]
        mine = pool.submit(served.post, "/v1/completions", plain)
        assert mine.result().json()["choices"][0]["text"] == want
        assert all(re.fullmatch("[0-9]{8}", g.result().json()["choices"][0]["text"])
                   for g in guided)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_gives_a_valid_tool_call(served, choice):
    r = served.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME],
        "tool_choice": choice, "max_tokens": 80, "seed": 3, "parallel_tool_calls": False})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert len(calls) >= 1
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert set(args) == {"city"} and len(args["city"]) <= 10
        else:
            assert call["function"]["name"] == "get_time" and args["zone"] in ("UTC", "CET")
    if isinstance(choice, dict):
        assert [x["function"]["name"] for x in calls] == ["get_time"]


def test_a_bad_schema_is_a_400_naming_the_field(served):
    r = served.post("/v1/chat/completions", {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = served.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER],
                                             "tool_choice": {"type": "function",
                                                             "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_guided_decoding_with_overlap_scheduling():
    from engine import LLM, SamplingParams
    from api_served import DEMO
    with LLM(DEMO, device="cpu", dtype="float32", num_kv_blocks=64,
             async_scheduling=True) as llm:
        outs = llm.generate(["a", "b", "c"], [
            SamplingParams(seed=s, max_tokens=80, guided={"json_schema": SCHEMA})
            for s in range(2)] + [SamplingParams(temperature=0, max_tokens=10)])
        ref = llm.generate(["c"], SamplingParams(temperature=0, max_tokens=10))[0]
    for o in outs[:2]:
        assert _matches(json.loads(o.text)), o.text
    assert outs[2].token_ids == ref.token_ids


def test_guided_fields_are_not_reported_as_ignored(served, caplog):
    import logging
    with caplog.at_level(logging.WARNING, logger="glassbox.api"):
        r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                            "guided_choice": ["a", "b"]})
    assert r.json()["choices"][0]["text"] in ("a", "b")
    assert "ignoring" not in " ".join(rec.getMessage() for rec in caplog.records)


# ---- schemas closed by default (vLLM's default backend, xgrammar, closes them) ----------------
def test_closed_schema_closes_every_object_that_says_nothing_and_keeps_explicit_choices():
    from api.structured import closed_schema
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"type": "object"}},
        "either": {"anyOf": [{"type": "object"}, {"type": "string"}]},
        "open": {"type": "object", "additionalProperties": True},
        "ref": {"$ref": "#/$defs/D"},
        "data": {"const": {"type": "object"}, "default": {"type": "object"}}},
        "$defs": {"D": {"properties": {"y": {"type": "string"}}}}}
    got = closed_schema(schema)
    p = got["properties"]
    assert got["additionalProperties"] is False
    assert p["properties"]["additionalProperties"] is False      # a property named "properties"
    assert "additionalProperties" not in got["properties"]       # ... is not a schema keyword
    assert p["tags"]["items"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in p["either"]["anyOf"][1]
    assert p["open"]["additionalProperties"] is True             # the schema's own choice
    assert got["$defs"]["D"]["additionalProperties"] is False
    assert p["data"]["const"] == {"type": "object"} == p["data"]["default"]    # data untouched
    assert "additionalProperties" not in schema                  # the request's copy as sent


OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 10}},
                   "required": ["city"]}}}       # no additionalProperties (LangChain's @tool)


def test_a_forced_tool_with_an_open_schema_gives_a_parsed_call_through_the_sdk(served):
    client = served.client()
    for seed in range(3):
        r = client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[OPEN_WEATHER], max_tokens=60, seed=seed, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}


def test_an_open_response_format_schema_is_closed(served):
    schema = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}
    for seed in range(3):
        r = served.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 80, "seed": seed,
                                                 "response_format": {"type": "json_schema",
                                                                     "json_schema": {
                                                                         "name": "p",
                                                                         "schema": schema}}})
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop" and _matches(json.loads(c["message"]["content"])), c


def test_chat_completions_parse_with_a_pydantic_model(served):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=150)

    r = served.client().chat.completions.parse(model=served.model, messages=ASK,
                                               response_format=Person, max_tokens=80, seed=1)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and 0 <= p.age <= 150

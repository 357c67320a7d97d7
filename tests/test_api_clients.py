"""The server driven by the client libraries people point at vLLM: LangChain's ChatOpenAI
(invoke, .batch, bind_tools, with_structured_output), LangChain's OpenAI completions (.batch),
and LiteLLM's hosted_vllm provider (plain and streaming), against the demo checkpoint."""
from __future__ import annotations

import json
import os
from typing import Annotated

from pydantic import Field

import pytest

from api_served import KEY

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch at import


def _greedy(llm, prompt, n):
    from engine import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0].text


def _chat(served, **kw):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(model=served.model, base_url=served.url + "/v1", api_key=KEY,
                         max_retries=0, timeout=60, **kw)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}}


def test_langchain_chat_invoke_and_batch(served):
    chat = _chat(served, temperature=0, max_tokens=8)
    msgs = [[("user", "hi")], [("user", "what is 2 + 2?")], [("user", "tell me a story")]]
    outs = chat.batch(msgs)
    one = chat.invoke(msgs[1])
    assert len(outs) == 3 and outs[1].content == one.content
    want = _greedy(served.llm, [{"role": "user", "content": "what is 2 + 2?"}], 8)
    assert one.content == want
    assert one.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_bind_tools_gets_tool_calls(served):
    chat = _chat(served, max_tokens=60, seed=1)
    ai = chat.bind_tools([WEATHER], tool_choice="required",
                                  parallel_tool_calls=False).invoke("Weather in Paris?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert isinstance(ai.tool_calls[0]["args"]["city"], str)
    assert ai.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("strict, seed", [(True, 2), (None, 3)], ids=["strict", "not-strict"])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(served, method, strict, seed):
    """Without strict, LangChain sends pydantic's schema as it is (no additionalProperties)."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    chat = _chat(served, max_tokens=80, seed=seed)
    kw = {} if strict is None else {"strict": strict}
    p = chat.with_structured_output(Person, method=method, **kw).invoke("Invent a person")
    assert isinstance(p, Person) and len(p.name) <= 10 and 0 <= p.age <= 120


def test_langchain_bind_tools_with_a_tool_function_whose_schema_is_open(served):
    """@tool's schema has no additionalProperties: closed by default, as vLLM's backend does,
    so the forced call ends instead of running to the token limit."""
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather in a city."""
        return "sunny"
    schema = get_weather.tool_call_schema.model_json_schema()
    assert "additionalProperties" not in str(schema) and "maxLength" in str(schema)
    chat = _chat(served, max_tokens=60, seed=1)
    ai = chat.bind_tools([get_weather], tool_choice="get_weather",
                         parallel_tool_calls=False).invoke("Weather in Paris?")
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"], ai
    assert set(ai.tool_calls[0]["args"]) == {"city"}
    assert ai.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_completions_batch(served):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.OpenAI(model=served.model, base_url=served.url + "/v1", api_key=KEY,
                    temperature=0, max_tokens=6, max_retries=0, batch_size=4)
    prompts = ["The quick brown fox", "one two three", "hello world"]
    assert llm.batch(prompts) == [_greedy(served.llm, p, 6) for p in prompts]


def test_litellm_hosted_vllm_chat_and_stream(served):
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"hosted_vllm/{served.model}", api_base=served.url + "/v1", api_key=KEY,
              messages=[{"role": "user", "content": "what is 2 + 2?"}], max_tokens=8,
              temperature=0)
    r = litellm.completion(**kw)
    want = _greedy(served.llm, kw["messages"], 8)
    assert r.choices[0].message.content == want
    assert r.usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw,
                                                                                stream=True))
    assert text == want


def test_litellm_structured_output(served):
    litellm = pytest.importorskip("litellm")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = litellm.completion(model=f"hosted_vllm/{served.model}", api_base=served.url + "/v1",
                           api_key=KEY, messages=[{"role": "user", "content": "json please"}],
                           max_tokens=30, response_format={
                               "type": "json_schema",
                               "json_schema": {"name": "x", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool)



def test_litellm_forced_tool_call_with_an_open_schema(served):
    """LiteLLM's hosted_vllm provider with a tool whose schema leaves objects open: closed by
    default, the forced call comes back parsed."""
    litellm = pytest.importorskip("litellm")
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 10}},
                       "required": ["city"]}}}
    r = litellm.completion(model=f"hosted_vllm/{served.model}", api_base=served.url + "/v1",
                           api_key=KEY, messages=[{"role": "user", "content": "Weather?"}],
                           tools=[tool], tool_choice={"type": "function",
                                                      "function": {"name": "get_weather"}},
                           max_tokens=60, seed=2)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_the_clients_response_models_are_built_before_threads_use_them():
    """conftest builds openai's deferred models (and each nested one) on one thread: a model
    still deferred would be rebuilt by the first of several threads at once, which raises in
    some of them (LangChain's .batch failed CI that way). In a fresh interpreter, so models
    that earlier tests built cannot hide one the builder misses."""
    pytest.importorskip("openai")
    import subprocess
    import sys
    code = """if True:
        from pydantic._internal._mock_val_ser import MockCoreSchema
        from client_models import build_response_models
        models = build_response_models()
        deferred = [m.__name__ for m in models
                    if isinstance(m.__dict__.get("__pydantic_core_schema__"), MockCoreSchema)]
        print(sorted(m.__name__ for m in models)); print(deferred)"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), timeout=120, check=True).stdout
    names, deferred = (eval(line) for line in out.strip().splitlines())
    assert {"ChatCompletion", "ChatCompletionChunk", "Completion", "ChatCompletionMessage",
            "Choice", "ChoiceDelta", "ChatCompletionMessageFunctionToolCall"} <= set(names)
    assert deferred == [], deferred

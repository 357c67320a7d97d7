"""The Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) driven by the clients
that call it: the openai SDK (whole and streamed, the SDK's event types in order), LangChain's
ChatOpenAI(use_responses_api=True) and litellm.responses. On the demo checkpoint the text means
nothing, so the tests assert structure and determinism (temperature 0 gives chat completions'
text for the same conversation); reasoning and tool-call replies of a given shape come from a
scripted engine (scripted_engine.py)."""
from __future__ import annotations

import json
import os

import pytest

from api_served import KEY
from scripted_engine import ScriptedLLM, demo_tokenizer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch at import

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}
THINK_REPLY = "<think>\nThe user greets me.\n</think>\n\nHello there!"
TOOL_REPLY = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}\n</tool_call>')


class Scripted:
    """A keyless server over a scripted engine: every reply is `reply`."""

    def __init__(self, reply: str):
        from api.server import BackgroundServer, create_app
        self.llm = ScriptedLLM(demo_tokenizer(), lambda ids: reply)
        self.server = BackgroundServer(create_app(self.llm))
        self.url = self.server.url

    def client(self, key: str = "alice"):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)

    def post(self, body: dict, key: str = "alice"):
        import httpx
        return httpx.post(self.url + "/v1/responses", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {key}"})


@pytest.fixture
def scripted():
    servers = []

    def make(reply: str = "ok") -> Scripted:
        servers.append(Scripted(reply))
        return servers[-1]
    yield make
    for s in servers:
        s.server.stop()


def chat_text(served, messages, n):
    r = served.client().chat.completions.create(model=served.model, messages=messages,
                                                max_tokens=n, temperature=0)
    return r.choices[0].message.content, r.usage


# ---- the openai SDK, on the demo checkpoint ----------------------------------------------------
def test_a_response_at_temperature_0_is_chat_completions_text(served):
    r = served.client().responses.create(model=served.model, instructions="Be brief.",
                                         input="what is 2 + 2?", max_output_tokens=8,
                                         temperature=0)
    text, usage = chat_text(served, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "what is 2 + 2?"}], 8)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens,
                                                             usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_cuts_the_reply_as_incomplete(served):
    r = served.client().responses.create(model=served.model, input="tell me a story",
                                         max_output_tokens=2, temperature=0,
                                         extra_body={"ignore_eos": True})    # vLLM's field
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"


def test_a_streamed_response_sends_the_sdk_events_that_add_up_to_the_whole(served):
    c = served.client()
    kw = dict(model=served.model, input="hello", max_output_tokens=8, temperature=0)
    whole = c.responses.create(**kw)
    events = list(c.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if whole.status == "completed"
                          else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with c.responses.stream(**kw) as stream:       # the SDK's accumulating helper
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


def test_a_forced_function_tool_comes_back_as_a_function_call_item(served):
    c = served.client()
    kw = dict(model=served.model, input="Weather in Paris?", tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
              temperature=0)
    r = c.responses.create(**kw)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str) and call.call_id
    events = list(c.responses.create(**kw, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    named = c.responses.create(**{**kw, "tool_choice": {"type": "function",
                                                        "name": "get_weather"}})
    assert named.output[0].type == "function_call"


def test_previous_response_id_continues_the_stored_conversation(served):
    c = served.client()
    first = c.responses.create(model=served.model, instructions="Be brief.", input="hello",
                               max_output_tokens=6, temperature=0)
    second = c.responses.create(model=served.model, previous_response_id=first.id,
                                input="and then?", max_output_tokens=6, temperature=0)
    # the first turn's reply is in the conversation; its instructions are not carried over
    text, _ = chat_text(served, [{"role": "user", "content": "hello"},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "and then?"}], 6)
    assert second.output_text == text and second.previous_response_id == first.id
    got = c.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text


def test_function_call_and_output_items_are_the_chat_tool_history(served):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = served.client().responses.create(model=served.model, input=items, tools=[WEATHER],
                                         tool_choice="none", max_output_tokens=6, temperature=0)
    text, _ = chat_text(served, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], 6)
    assert r.output_text == text


def test_text_format_json_schema_gives_json_matching_the_schema(served):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    r = served.client().responses.create(
        model=served.model, input="json please", max_output_tokens=20, temperature=0,
        text={"format": {"type": "json_schema", "name": "flag", "schema": schema,
                         "strict": True}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)


def test_logprobs_are_chat_completions_logprobs_whole_and_streamed(served):
    c = served.client()
    kw = dict(model=served.model, input="hello", max_output_tokens=8, temperature=0,
              top_logprobs=2, include=["message.output_text.logprobs"])
    r = c.responses.create(**kw)
    chat = c.chat.completions.create(model=served.model, max_tokens=8, temperature=0,
                                     messages=[{"role": "user", "content": "hello"}],
                                     logprobs=True, top_logprobs=2)
    want = [(t.token, t.logprob, [a.token for a in t.top_logprobs])
            for t in chat.choices[0].logprobs.content]
    got = r.output[0].content[0].logprobs
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in got] == want
    events = list(c.responses.create(**kw, stream=True))
    streamed = [t.token for e in events if e.type == "response.output_text.delta"
                for t in e.logprobs]
    assert streamed == [t.token for t in got]


def test_a_watched_response_has_a_trace_like_any_api_request(served):
    import httpx
    r = served.post("/v1/responses", {"input": "hi", "max_output_tokens": 3,
                                      "glassbox": {"watch": True}}).json()
    assert r["glassbox"]["watched"] is True
    trace = httpx.get(served.url + r["glassbox"]["trace_url"], headers=served.headers,
                      timeout=30)
    assert trace.status_code == 200


def test_the_sdk_parse_helper_reads_structured_output(served):
    from pydantic import BaseModel

    class Flag(BaseModel):
        ok: bool
    r = served.client().responses.parse(model=served.model, input="json please",
                                        text_format=Flag, max_output_tokens=20, temperature=0)
    assert isinstance(r.output_parsed, Flag)


# ---- reasoning and tool-call replies (scripted) ------------------------------------------------
def test_thinking_becomes_a_reasoning_item_whole_and_streamed(scripted):
    s = scripted(THINK_REPLY)
    c = s.client()
    r = c.responses.create(model="scripted", input="hi", max_output_tokens=100)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nThe user greets me.\n"
    assert r.output_text == "Hello there!" and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(c.responses.create(model="scripted", input="hi", max_output_tokens=100,
                                     stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (r.output[0].content[0].text, r.output_text)
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == \
        ["reasoning", "message"]


def test_a_tool_call_reply_streams_its_text_then_the_call(scripted):
    s = scripted(TOOL_REPLY)
    c = s.client()
    r = c.responses.create(model="scripted", input="Weather?", tools=[WEATHER])
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Let me check. " and json.loads(r.output[1].arguments) == \
        {"city": "Paris"}
    events = list(c.responses.create(model="scripted", input="Weather?", tools=[WEATHER],
                                     stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call"]
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    final = events[-1].response
    assert final.output[1].name == "get_weather" and final.output[1].status == "completed"


def test_every_event_and_the_response_validate_against_the_sdks_types(scripted):
    """Validated, not merely constructed (the SDK constructs without checking)."""
    import httpx
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    s = scripted(THINK_REPLY.replace("Hello there!", TOOL_REPLY))
    body = {"input": "Weather?", "tools": [WEATHER], "max_output_tokens": 200}
    Response.model_validate(s.post(body).json())
    streamed = {**body, "stream": True, "stream_options": {"include_obfuscation": False}}
    with httpx.stream("POST", s.url + "/v1/responses", json=streamed,
                      timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    types = [adapter.validate_python(e).type for e in events]
    assert types[-1] == "response.completed" and "response.reasoning_text.delta" in types
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == \
        ["reasoning", "message", "function_call"]


def test_a_client_that_leaves_mid_stream_aborts_the_request_and_stores_nothing(scripted):
    import time

    import httpx
    s = scripted("word " * 400)
    s.llm.token_s = 0.01
    with httpx.stream("POST", s.url + "/v1/responses", json={"input": "hi", "stream": True},
                      timeout=30) as r:
        for line in r.iter_lines():
            if '"response.output_text.delta"' in line:
                break           # leave after the first token
    deadline = time.time() + 10
    while not s.llm._aborted and time.time() < deadline:
        time.sleep(0.05)
    (rid,) = s.llm._aborted         # the response's id is its engine request's
    assert rid.startswith("resp-")
    import openai
    with pytest.raises(openai.NotFoundError):
        s.client().responses.retrieve(rid)


def test_the_second_turn_sees_the_first_turns_reply_and_tool_calls(scripted):
    s = scripted(TOOL_REPLY)
    c = s.client()
    first = c.responses.create(model="scripted", input="Weather?", tools=[WEATHER])
    c.responses.create(model="scripted", previous_response_id=first.id, tools=[WEATHER],
                       input=[{"type": "function_call_output",
                               "call_id": first.output[1].call_id, "output": "sunny"}])
    prompt = s.llm.tokenizer.decode(s.llm.prompts[-1])
    assert "Weather?" in prompt and "Let me check." in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_chat_fields_pass_through_under_their_chat_names(scripted):
    s = scripted("ok")
    r = s.post({"input": "hi", "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert s.llm.tokenizer.decode(s.llm.prompts[-1]).endswith("<think>\n\n</think>\n\n")


def test_reasoning_effort_none_turns_qwen3_thinking_off(scripted):
    s = scripted("ok")
    assert s.post({"input": "hi", "reasoning": {"effort": "none"}}).status_code == 200
    assert s.llm.tokenizer.decode(s.llm.prompts[-1]).endswith("<think>\n\n</think>\n\n")
    assert s.post({"input": "hi", "reasoning": {"effort": "high"}}).status_code == 200
    assert s.llm.tokenizer.decode(s.llm.prompts[-1]).endswith("<|im_start|>assistant\n")


# ---- the store ---------------------------------------------------------------------------------
def test_stored_responses_are_private_to_the_key_that_made_them(scripted):
    import openai
    s = scripted("hello")
    alice, bob = s.client("alice"), s.client("bob")
    r = alice.responses.create(model="scripted", input="hi")
    assert alice.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        bob.responses.create(model="scripted", input="hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)


def test_a_stored_responses_input_items_are_listed_with_the_sdk(scripted):
    s = scripted("hello")
    c = s.client()
    r = c.responses.create(model="scripted", input=[
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "reply"},
        {"role": "user", "content": [{"type": "input_text", "text": "second"}]}])
    items = c.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["second", "reply", "first"]
    asc = c.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["first", "reply"] and asc.has_more
    assert [i.content[0].text for i in c.responses.input_items.list(
        r.id, order="asc", after=asc.data[-1].id).data] == ["second"]


def test_a_keyed_server_wants_its_key_on_every_responses_route(served):
    import httpx
    for method, path in [("POST", "/v1/responses"), ("GET", "/v1/responses/resp-x"),
                         ("GET", "/v1/responses/resp-x/input_items"),
                         ("DELETE", "/v1/responses/resp-x")]:
        r = httpx.request(method, served.url + path, json={"input": "hi"} if method == "POST"
                          else None, headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_store_false_keeps_nothing(scripted):
    import openai
    s = scripted("hello")
    r = s.client().responses.create(model="scripted", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        s.client().responses.retrieve(r.id)


def test_the_store_is_bounded_least_recently_used_first():
    from api.response_store import ResponseStore
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put("me", {"id": f"r{i}"}, [])
        if i == 1:
            assert store.get("me", "r0") is not None     # r0 used: r1 is the oldest now
    assert store.get("me", "r1") is None and store.get("me", "r0") is not None
    assert store.get("you", "r2") is None and len(store) == 2
    small = ResponseStore(max_bytes=200)
    small.put("me", {"id": "a", "x": "y" * 100}, [])
    small.put("me", {"id": "b", "x": "y" * 100}, [])
    assert small.get("me", "a") is None and small.get("me", "b") is not None


# ---- bad requests: a 400 naming the field ------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "messages": []}, "messages"),
    ({"input": "hi", "top_k": "many"}, "top_k"),
    ({"input": "hi", "ignore_eos": "true"}, "ignore_eos"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "glassbox": {"watch": "yes"}}, "glassbox.watch"),
])
def test_a_bad_request_is_a_400_naming_the_field(scripted, body, param):
    r = scripted().post(body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ---- LangChain and LiteLLM ---------------------------------------------------------------------
def _langchain(served, **kw):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(model=served.model, base_url=served.url + "/v1", api_key=KEY,
                         use_responses_api=True, max_retries=0, timeout=60, **kw)


def test_langchain_use_responses_api_invoke(served):
    chat = _langchain(served, temperature=0, max_tokens=8)
    ai = chat.invoke("what is 2 + 2?")
    text, _ = chat_text(served, [{"role": "user", "content": "what is 2 + 2?"}], 8)
    assert ai.text == text
    assert ai.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.text for chunk in chat.stream("what is 2 + 2?")) == text


def test_langchain_use_responses_api_batch(served):
    chat = _langchain(served, temperature=0, max_tokens=6)
    prompts = ["hi", "what is 2 + 2?", "tell me a story"]
    outs = chat.batch(prompts)          # a thread per request
    assert [o.text for o in outs] == [chat_text(served, [{"role": "user", "content": p}], 6)[0]
                                      for p in prompts]


def test_langchain_use_responses_api_bind_tools(served):
    ai = _langchain(served, temperature=0, max_tokens=60).bind_tools(
        [WEATHER], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Paris?")
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    assert isinstance(ai.tool_calls[0]["args"]["city"], str)


def test_litellm_responses(served):
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"hosted_vllm/{served.model}", input="what is 2 + 2?",
              api_base=served.url + "/v1", api_key=KEY, max_output_tokens=8, temperature=0)
    r = litellm.responses(**kw)
    text, _ = chat_text(served, [{"role": "user", "content": "what is 2 + 2?"}], 8)
    got = "".join(part.text for item in r.output if item.type == "message"
                  for part in item.content)
    assert got == text and r.usage.output_tokens > 0
    deltas = [e.delta for e in litellm.responses(**kw, stream=True)
              if getattr(e, "type", None) == "response.output_text.delta"]
    assert "".join(deltas) == text

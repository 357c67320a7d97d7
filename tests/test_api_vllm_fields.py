"""What current vLLM clients send beyond OpenAI's fields: `structured_outputs` (vLLM 0.12
replaced guided_* with it), `truncate_prompt_tokens`, and the sampling/output fields Glassbox
does not honour — each served at its neutral value and a 400 naming it otherwise, never a
reply that silently ignored it. On the demo checkpoint."""
from __future__ import annotations

import json
import logging
import re

import pytest

from api_served import ServedAPI

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99},
                                           "w": {"type": "string", "maxLength": 6}},
          "required": ["n", "w"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    s = ServedAPI()
    yield s
    s.close()


def _greedy(llm, prompt, n):
    from engine import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0]


def _err(r) -> tuple[int, str | None, str]:
    e = r.json().get("error", {})
    return r.status_code, e.get("param"), e.get("message", "")


# ---- structured_outputs ---------------------------------------------------------------------
def test_structured_outputs_choice_regex_json_constrain_the_reply(served, caplog):
    with caplog.at_level(logging.WARNING, logger="glassbox.api"):
        for seed in range(3):
            r = served.post("/v1/completions", {
                "prompt": "The answer is", "max_tokens": 10, "seed": seed,
                "structured_outputs": {"choice": ["yes", "no", "maybe later"]}})
            assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe later"), r.text
            r = served.post("/v1/completions", {
                "prompt": "The code is", "max_tokens": 12, "seed": seed,
                "structured_outputs": {"regex": r"[A-F]{3}-\d{2}"}})
            assert re.fullmatch(r"[A-F]{3}-\d{2}", r.json()["choices"][0]["text"]), r.text
            r = served.post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40,
                "seed": seed, "structured_outputs": {"json": SCHEMA,
                                                     "disable_any_whitespace": True}})
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "stop", c
            obj = json.loads(c["message"]["content"])
            assert set(obj) == {"n", "w"} and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
            assert isinstance(obj["w"], str) and len(obj["w"]) <= 6
    # known fields: nothing of them is reported as ignored
    assert "ignoring" not in " ".join(rec.getMessage() for rec in caplog.records)


def test_structured_outputs_json_as_a_string_and_json_object(served):
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 40, "seed": 3,
                                        "structured_outputs": {"json": json.dumps(SCHEMA)}})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and set(json.loads(c["text"])) == {"n", "w"}, c
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 60, "seed": 1,
                                        "temperature": 0,
                                        "structured_outputs": {"json_object": True}})
    c = r.json()["choices"][0]
    assert r.status_code == 200 and c["text"].lstrip().startswith("{"), c
    if c["finish_reason"] == "stop":        # an open-ended object may not close in 60 tokens
        assert isinstance(json.loads(c["text"]), dict)


def test_the_same_reply_as_the_guided_field_it_replaced(served):
    old = served.post("/v1/completions", {"prompt": "The code is", "max_tokens": 12, "seed": 7,
                                          "guided_regex": r"[a-z]{4}\d"}).json()
    new = served.post("/v1/completions", {"prompt": "The code is", "max_tokens": 12, "seed": 7,
                                          "structured_outputs": {"regex": r"[a-z]{4}\d"}}).json()
    assert new["choices"][0]["text"] == old["choices"][0]["text"]


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "x" * 100_001}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": "not json"}},
     "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"guided_grammar": "root ::= [a-"}, "guided_grammar"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structural_tag": {"structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}],
                         "triggers": ["<y"]}}, "structural_tag"),
])
def test_structured_outputs_it_cannot_use_are_400s_naming_the_field(served, body, param):
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
    status, got, msg = _err(r)
    assert (status, got) == (400, param), r.text
    assert msg


def test_neutral_structured_flags_are_served(served):
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "seed": 0,
                                        "guided_decoding_backend": "xgrammar",
                                        "structured_outputs": {"choice": ["ab", "cd"],
                                                               "disable_fallback": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("ab", "cd"), r.text
    # closes open objects: every schema here is closed already
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 40, "seed": 0,
                                        "structured_outputs": {
                                            "json": {k: v for k, v in SCHEMA.items()
                                                     if k != "additionalProperties"},
                                            "disable_additional_properties": True}})
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"n", "w"}, r.text


# one language, as GBNF (llama.cpp's / xgrammar's syntax) and as Lark (llguidance's)
GBNF = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
LARK = 'start: answer " " DIGIT\nanswer: "yes" | "no"\nDIGIT: /[0-9]/'


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
@pytest.mark.parametrize("grammar", [GBNF, LARK], ids=["gbnf", "lark"])
def test_a_grammar_constrains_the_reply(served, field, grammar):
    for seed in range(3):
        g = {"structured_outputs": {"grammar": grammar}} if field == "structured_outputs" \
            else {"guided_grammar": grammar}
        r = served.post("/v1/completions", {"prompt": "Is it? ", "max_tokens": 8, "seed": seed,
                                            **g})
        c = r.json()["choices"][0]
        assert re.fullmatch(r"(yes|no) [0-9]", c["text"]) and c["finish_reason"] == "stop", r.text
    r = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "ok?"}],
                                             "max_tokens": 8, "seed": 1,
                                             "structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"(yes|no) [0-9]", r.json()["choices"][0]["message"]["content"])


TAG = {"type": "structural_tag", "triggers": ["the"],
       "structures": [{"begin": "the ", "schema": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}, "end": "!"}]}


@pytest.mark.parametrize("how", ["structural_tag", "structured_outputs", "response_format"])
def test_a_structural_tag_leaves_text_free_and_constrains_what_follows_a_trigger(served, how):
    """vLLM's structural tag: free text; after a trigger, the structure's begin, JSON that
    matches its schema, its end. The trigger is a word the demo model writes often."""
    prompt = "In the beginning, the"
    msgs = [{"role": "user", "content": "Tell me about the world"}]
    tagged = 0
    for seed in range(4):
        if how == "response_format":
            body = {"messages": msgs, "response_format": TAG}
        else:
            body = {"prompt": prompt, **({"structural_tag": json.dumps(TAG)}
                                         if how == "structural_tag" else
                                         {"structured_outputs": {"structural_tag": TAG}})}
        r = served.post("/v1/chat/completions" if how == "response_format" else
                        "/v1/completions", {**body, "max_tokens": 40, "seed": seed})
        c = r.json()["choices"][0]
        text = c["message"]["content"] if how == "response_format" else c["text"]
        if c["finish_reason"] == "length":      # the last tag may be cut short
            text = re.sub(r"(t|th|the|the |the [0-9])$", "", text)
        # every "the" begins a whole tag holding one digit
        assert all(re.match(r"the [0-9]!", text[m.start():])
                   for m in re.finditer("the", text)), text
        tagged += len(re.findall("the [0-9]!", text))
    assert tagged, "no reply wrote a tag: the test saw nothing constrained"


# ---- fields held to their neutral value ----------------------------------------------------
NEUTRAL = [("use_beam_search", False, True), ("length_penalty", 1.0, 0.5),
           ("include_stop_str_in_output", False, True), ("allowed_token_ids", [], [1, 2]),
           ("bad_words", [], ["the"]), ("logits_processors", [], ["my.module:proc"]),
           ("return_tokens_as_token_ids", False, True), ("skip_special_tokens", True, False),
           ("spaces_between_special_tokens", True, False)]


@pytest.mark.parametrize("name, neutral, other", NEUTRAL, ids=[n for n, _, _ in NEUTRAL])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_fields_serve_at_their_neutral_value_and_refuse_any_other(served, route, name,
                                                                       neutral, other):
    base = {"max_tokens": 3, "temperature": 0}
    base.update({"prompt": "Hello"} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "Hello"}]})
    ok = served.post(route, {**base, name: neutral})
    plain = served.post(route, base)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"] == plain.json()["choices"]      # neutral: the same reply
    bad = served.post(route, {**base, name: other})
    status, param, msg = _err(bad)
    assert (status, param) == (400, name), bad.text
    assert "not supported" in msg


def test_chat_echo_is_refused_and_completions_echo_still_works(served):
    r = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "echo": True, "max_tokens": 2})
    assert _err(r)[:2] == (400, "echo"), r.text
    r = served.post("/v1/completions", {"prompt": "hi there", "echo": True, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi there")


# ---- truncate_prompt_tokens ------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_k_token_ids(served):
    llm = served.llm
    import random
    rng = random.Random(11)
    ids = [rng.randrange(100, 4000) for _ in range(llm.max_model_len + 40)]   # cannot fit whole
    r = served.post("/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0,
                                        "truncate_prompt_tokens": 24})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 24
    assert body["choices"][0]["text"] == _greedy(llm, ids[-24:], 5).text
    whole = served.post("/v1/completions", {"prompt": ids, "max_tokens": 5})
    assert whole.status_code == 400        # without it, the same prompt cannot fit


def test_truncate_prompt_tokens_on_text_chat_and_echo(served):
    llm = served.llm
    text = " ".join(f"word{i}" for i in range(60))
    full = llm.encode(text)
    assert len(full) > 20
    r = served.post("/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0,
                                        "truncate_prompt_tokens": 20, "echo": True})
    c, usage = r.json()["choices"][0], r.json()["usage"]
    assert usage["prompt_tokens"] == 20
    shown = llm.tokenizer.decode(full[-20:])
    assert c["text"].startswith(shown)          # echo: the prompt the model read
    assert c["text"][len(shown):] == _greedy(llm, full[-20:], 4).text
    msgs = [{"role": "user", "content": text}]
    r = served.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0,
                                             "truncate_prompt_tokens": 16})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16, r.text
    assert r.json()["choices"][0]["message"]["content"] == \
        _greedy(llm, llm.encode(msgs)[-16:], 4).text
    # longer than the prompt, or -1 (max_model_len): the prompt as it is
    for k in (10_000, -1):
        r = served.post("/v1/completions", {"prompt": text, "max_tokens": 2, "temperature": 0,
                                            "truncate_prompt_tokens": k})
        assert r.json()["usage"]["prompt_tokens"] == len(full), r.text


@pytest.mark.parametrize("k", [0, -2])
def test_a_bad_truncate_prompt_tokens_is_a_400(served, k):
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                        "truncate_prompt_tokens": k})
    assert _err(r)[:2] == (400, "truncate_prompt_tokens"), r.text


# ---- return_token_ids ----------------------------------------------------------------------
def _stream(served, route, body) -> list[dict]:
    import httpx
    chunks = []
    with httpx.stream("POST", served.url + route, json={**body, "stream": True},
                      headers=served.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_return_token_ids_on_completions(served):
    llm = served.llm
    prompt = "Once upon a time"
    want = _greedy(llm, prompt, 12)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    c = served.post("/v1/completions", body).json()["choices"][0]
    assert c["prompt_token_ids"] == llm.encode(prompt)
    assert c["token_ids"] == list(want.token_ids) and c["text"] == want.text
    plain = served.post("/v1/completions", {**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]           # only when asked
    # streamed: the prompt's ids on the first chunk only, every generated id exactly once
    chunks = _stream(served, "/v1/completions", body)
    firsts = [ch["choices"][0].get("prompt_token_ids") for ch in chunks]
    assert firsts[0] == llm.encode(prompt) and not any(firsts[1:])
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == list(want.token_ids)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == want.text


def test_streamed_token_ids_survive_held_back_text_and_n(served):
    llm = served.llm
    prompt = "The list: one, two,"
    ref = _greedy(llm, prompt, 16)
    stop = ref.text[4:7]            # a stop string inside the greedy reply: text held back
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stop": [stop],
            "return_token_ids": True}
    whole = served.post("/v1/completions", body).json()["choices"][0]
    chunks = _stream(served, "/v1/completions", body)
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == whole["token_ids"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["text"]
    # n = 2, seeded: each choice's ids on its own chunks, the same as its body's
    body = {"prompt": prompt, "max_tokens": 8, "seed": 5, "n": 2, "return_token_ids": True}
    full = {c["index"]: c["token_ids"] for c in served.post("/v1/completions", body)
            .json()["choices"]}
    got: dict[int, list] = {0: [], 1: []}
    for ch in _stream(served, "/v1/completions", body):
        for c in ch["choices"]:
            got[c["index"]] += c.get("token_ids") or []
    assert got == full and all(len(v) == 8 for v in got.values())


def test_return_token_ids_on_chat(served):
    llm = served.llm
    msgs = [{"role": "user", "content": "Say something short."}]
    body = {"messages": msgs, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    r = served.post("/v1/chat/completions", body).json()
    want = _greedy(llm, llm.encode(msgs), 10)
    assert r["prompt_token_ids"] == llm.encode(msgs)         # chat: on the response
    assert r["choices"][0]["token_ids"] == list(want.token_ids)
    chunks = _stream(served, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == llm.encode(msgs)
    assert not any(ch.get("prompt_token_ids") for ch in chunks[1:])
    ids = [t for ch in chunks for c in ch["choices"] for t in (c.get("token_ids") or [])]
    assert ids == list(want.token_ids)


def test_streamed_token_ids_through_the_tool_call_parser(served):
    """With tools the chat stream is parsed (content / tool-call deltas of their own): the
    token ids still arrive each once, in order."""
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    for choice in ("auto", "required"):
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool],
                "tool_choice": choice, "max_tokens": 40, "seed": 2, "return_token_ids": True}
        whole = served.post("/v1/chat/completions", body).json()
        chunks = _stream(served, "/v1/chat/completions", body)
        ids = [t for ch in chunks for c in ch["choices"] for t in (c.get("token_ids") or [])]
        assert ids == whole["choices"][0]["token_ids"] and ids, choice
        assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]


# ---- cache_salt --------------------------------------------------------------------------------
def test_cache_salt_reaches_the_engine_and_a_bad_one_is_a_400(served):
    from engine import SamplingParams
    llm = served.llm
    import random
    rng = random.Random(5)
    ids = [rng.randrange(100, 4000) for _ in range(3 * 16 + 3)]      # 3 full 16-token blocks
    r = served.post("/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0,
                                        "cache_salt": "team-a"})
    assert r.status_code == 200, r.text

    def cached(salt):
        return llm.generate([ids], SamplingParams(temperature=0, max_tokens=2),
                            cache_salt=salt)[0].metrics["prefix_cached_blocks"]
    assert cached("team-b") == 0            # another salt: none of team-a's blocks
    assert cached("team-a") == 3            # the API's request cached them under its salt
    assert cached(None) == 0
    for bad in ("", "x" * 5000):
        r = served.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "cache_salt": bad})
        assert _err(r)[:2] == (400, "cache_salt"), r.text


# ---- stream_options.continuous_usage_stats ----------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(served, route):
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    base.update({"prompt": "Count with me:"} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "Count with me"}]})
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _stream(served, route, {**base, "stream_options": opts})
    body = [c for c in chunks if c["choices"]]
    final = chunks[-1]
    assert not final["choices"] and final["usage"]["completion_tokens"] == 6
    prompt = final["usage"]["prompt_tokens"]
    done = [c["usage"]["completion_tokens"] for c in body]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in body)
    assert all(c["usage"]["total_tokens"] == prompt + d for c, d in zip(body, done))
    assert done == sorted(done) and done[-1] == 6 and done[0] >= 0
    if route == "/v1/chat/completions":
        assert done[0] == 0                     # the role chunk: no token yet
    # the text is the same as without; without include_usage, no usage at all (vLLM's rule)
    text = lambda cs: "".join(c["choices"][0].get("text") or
                              (c["choices"][0].get("delta") or {}).get("content") or ""
                              for c in cs if c["choices"])
    plain = _stream(served, route, {**base, "stream_options": {"include_usage": True}})
    assert text(chunks) == text(plain)
    assert all(c["usage"] is None for c in plain if c["choices"])
    bare = _stream(served, route, {**base, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in bare) and text(bare) == text(chunks)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                   "chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ("/v1/completions", {"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds"),
])
def test_a_request_template_or_embeddings_are_refused_not_ignored(served, route, body, param):
    r = served.post(route, {"max_tokens": 2, **body} if route != "/tokenize" else body)
    assert _err(r)[:2] == (400, param), r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_priority_is_served_and_a_non_integer_is_a_400(served, route):
    base = {"max_tokens": 3, "temperature": 0}
    base.update({"prompt": "Hello"} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "Hello"}]})
    plain = served.post(route, base)
    urgent = served.post(route, {**base, "priority": -5})
    assert urgent.status_code == 200, urgent.text
    assert urgent.json()["choices"] == plain.json()["choices"]   # order changes, not the reply
    status, param, _ = _err(served.post(route, {**base, "priority": "high"}))
    assert (status, param) == (400, "priority")


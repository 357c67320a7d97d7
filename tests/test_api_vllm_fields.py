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
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structural_tag": "{}"}, "structural_tag"),
])
def test_structured_outputs_it_cannot_honour_are_400s_naming_the_field(served, body, param):
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


# ---- fields held to their neutral value ----------------------------------------------------
NEUTRAL = [("use_beam_search", False, True), ("length_penalty", 1.0, 0.5),
           ("include_stop_str_in_output", False, True), ("allowed_token_ids", [], [1, 2]),
           ("bad_words", [], ["the"]), ("logits_processors", [], ["my.module:proc"]),
           ("return_tokens_as_token_ids", False, True), ("skip_special_tokens", True, False),
           ("spaces_between_special_tokens", True, False), ("priority", 0, 3)]


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

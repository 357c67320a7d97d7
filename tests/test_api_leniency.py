"""The API is lenient where vLLM's server is (unknown fields ignored with a warning, null means
the default, `model` optional) and strict where it is (max_tokens beyond the context is a 400
naming the limit); X-Request-Id names the request; stop_reason and stop-token text as vLLM."""
from __future__ import annotations

import json
import logging

import pytest


PROMPT = "The quick brown fox"


def _greedy(llm, prompt, **kw):
    from engine import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0, **kw))[0]


def _greedy_completion(served, **fields):
    """POST /v1/completions (greedy, 12 tokens, streamed or not): the response, its last
    choice and the whole text."""
    r = served.post("/v1/completions",
                    {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields})
    if not fields.get("stream"):
        return r, r.json()["choices"][0], r.json()["choices"][0]["text"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return r, chunks[-1]["choices"][0], "".join(c["choices"][0]["text"] for c in chunks)


def test_unknown_fields_are_ignored_with_a_logged_warning(served, caplog):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "reasoning_effort": "low", "functions": [], "include_stop_str_in_output": False,
            "skip_special_tokens": True, "stream_options": None, "chat_template_kwargs": {}}
    with caplog.at_level(logging.WARNING, logger="glassbox.api"):
        r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _greedy(served.llm, PROMPT, max_tokens=5).text
    warned = " ".join(rec.getMessage() for rec in caplog.records)
    for name in ("reasoning_effort", "functions", "chat_template_kwargs"):   # (a chat field)
        assert name in warned
    # vLLM's own fields are known (at their neutral values: served as asked), not "unknown"
    for name in ("skip_special_tokens", "include_stop_str_in_output"):
        assert name not in warned


def test_unknown_fields_inside_stream_options_are_ignored(served):
    r = served.post("/v1/chat/completions", {
        "model": served.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200 and '"usage":{"prompt_tokens"' in r.text


@pytest.mark.parametrize("field", ["n", "stream", "logprobs", "echo", "stream_options",
                                   "temperature", "top_p", "stop", "seed", "ignore_eos",
                                   "min_tokens", "max_tokens", "user"])
def test_an_explicit_null_means_the_default(served, field):
    body = {"model": served.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 4,
            field: None}
    r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 1 and choices[0]["logprobs"] is None


def test_null_include_usage_in_a_stream_means_no_usage_chunk(served):
    r = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                        "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and '"usage"' not in r.text and r.text.endswith("[DONE]\n\n")


def test_model_may_be_left_out(served):
    c = served.client()
    r = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == served.model
    assert c.completions.create(model=served.model, prompt=PROMPT, max_tokens=2).choices


def test_max_tokens_beyond_the_context_is_a_400_naming_the_limit(served):
    n_prompt = len(served.llm.encode(PROMPT))
    limit = served.llm.max_model_len
    r = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": limit})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens"
    assert f"maximum context length is {limit} tokens" in err["message"]
    assert f"{n_prompt} input tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"
    r = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "max_completion_tokens": limit})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    # exactly the room left is allowed
    ok = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": limit - n_prompt,
                                         "temperature": 0, "stop": ["."]})
    assert ok.status_code == 200, ok.text


def test_the_default_max_tokens_is_the_room_left_for_chat(served):
    msgs = [{"role": "user", "content": "hi"}]
    n_prompt = len(served.llm.encode(msgs))
    r = served.post("/v1/chat/completions", {"messages": msgs, "ignore_eos": True,
                                             "temperature": 0})
    u = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert u["prompt_tokens"] == n_prompt
    assert u["completion_tokens"] == served.llm.max_model_len - n_prompt


def test_x_request_id_is_echoed_but_never_the_engines_key(served):
    """vLLM echoes X-Request-Id; here the engine's key (the reply's id, the playground's row)
    is always the server's own, unguessable id (issue #48.6: predictable or client-chosen ids
    let one client take another's next id, and read its trace)."""
    seen = []
    served.llm.finish_listeners.append(lambda ev: seen.append(ev.request_id))
    try:
        for _ in range(2):          # the same id twice: both served (nothing to squat)
            r = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
                            headers={"X-Request-Id": "my-eval-item-17"})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "my-eval-item-17"
            assert r.json()["id"].startswith("cmpl-") and r.json()["id"] in seen
        assert "my-eval-item-17" not in seen
        s = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                 "max_tokens": 2, "stream": True},
                        headers={"X-Request-Id": "stream-1"})
        assert s.headers["x-request-id"] == "stream-1" and '"id":"chatcmpl-' in s.text
        body_id = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                  "request_id": "from-body"})
        assert body_id.status_code == 200 and "from-body" not in seen
        # unguessable: two ids share no more than their kind and differ in 64 random bits
        a, b = (served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()["id"]
                for _ in range(2))
        assert a.split("-")[1] != b.split("-")[1] and len(a.split("-")[1]) == 16
    finally:
        served.llm.finish_listeners.clear()
    bad = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                      headers={"X-Request-Id": "x" * 300})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_a_generated_request_id_is_echoed_too(served):
    r = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert r.headers["x-request-id"] == r.json()["id"]


def test_stop_reason_is_the_stop_string(served):
    full = _greedy(served.llm, PROMPT, max_tokens=12).text      # ' widget is that the 5.x. ...'
    stop = full.split()[2]                                       # a word in the middle
    for stream in (False, True):
        _, last, text = _greedy_completion(served, stop=["zzz", stop], stream=stream)
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
        assert text == full[:full.index(stop)]


def test_a_stop_token_id_ends_the_reply_without_its_text(served):
    out = _greedy(served.llm, PROMPT, max_tokens=12)
    k = 4
    stop_id = out.token_ids[k]
    assert stop_id not in out.token_ids[:k]
    want = served.llm.tokenizer.decode(out.token_ids[:k])
    for stream in (False, True):
        r, last, text = _greedy_completion(served, stop_token_ids=[stop_id], stream=stream)
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_id)
        assert text == want
        assert r.json()["usage"]["completion_tokens"] == k + 1 if not stream else True


def test_stop_reason_is_null_for_eos_and_length(served):
    r = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "temperature": 0, "max_tokens": 30})
    c = r.json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", None)      # ends on <|im_end|>
    r = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    c = r.json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None)


def test_min_tokens_holds_back_the_stop_token(served):
    msgs = [{"role": "user", "content": "hi"}]
    r = served.post("/v1/chat/completions", {"messages": msgs, "temperature": 0,
                                             "max_tokens": 30, "min_tokens": 6})
    assert r.json()["usage"]["completion_tokens"] >= 6
    plain = served.post("/v1/chat/completions", {"messages": msgs, "temperature": 0,
                                                 "max_tokens": 30})
    assert plain.json()["usage"]["completion_tokens"] < 6


def test_penalties_and_logit_bias_reach_the_sampler(served):
    from engine import SamplingParams
    tok = served.llm.tokenizer
    forced = tok.encode(" fox")[0]
    r = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                        "logit_bias": {str(forced): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([forced] * 4)
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    r = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                        **kw})
    want = served.llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, **kw))[0]
    assert r.json()["choices"][0]["text"] == want.text
    assert want.text != _greedy(served.llm, PROMPT, max_tokens=12).text

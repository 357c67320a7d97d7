"""What current vLLM clients send beyond OpenAI's fields: `structured_outputs` (vLLM 0.12
replaced guided_* with it; grammars and structural tags included), `truncate_prompt_tokens`,
vLLM's sampling / output fields (allowed_token_ids, bad_words, include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens, chat echo), each tested against the
behaviour vLLM documents, and the few Glassbox does not honour (beam search, custom logits
processors, ...) — served at their neutral value and a 400 naming them otherwise, never a reply
that silently ignored them. On the demo checkpoint."""
from __future__ import annotations

import json
import logging
import re

import pytest


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99},
                                           "w": {"type": "string", "maxLength": 6}},
          "required": ["n", "w"], "additionalProperties": False}


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
           ("logits_processors", [], ["my.module:proc"])]


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


# ---- vLLM's sampling / output fields, honoured -----------------------------------------------
HONOURED_DEFAULTS = [("include_stop_str_in_output", False), ("skip_special_tokens", True),
                     ("return_tokens_as_token_ids", False),
                     ("spaces_between_special_tokens", True), ("bad_words", []),
                     ("allowed_token_ids", None)]


@pytest.mark.parametrize("name, default", HONOURED_DEFAULTS, ids=[n for n, _ in HONOURED_DEFAULTS])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_honoured_fields_at_their_default_give_the_same_reply(served, route, name, default):
    base = {"max_tokens": 6, "temperature": 0}
    base.update({"prompt": "Hello"} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "Hello"}]})
    assert served.post(route, {**base, name: default}).json()["choices"] == \
        served.post(route, base).json()["choices"]


def _ids(r) -> list[int]:
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_allowed_token_ids_every_generated_id_is_in_the_set(served, route):
    allowed = [5, 77, 300, 1024, 2048]
    base = {"prompt": "Once upon a time"} if route == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "Once upon a time"}]}
    for seed in range(3):
        r = served.post(route, {**base, "max_tokens": 12, "seed": seed, "ignore_eos": True,
                                "allowed_token_ids": allowed, "return_token_ids": True})
        ids = _ids(r)
        assert len(ids) == 12 and set(ids) <= set(allowed), r.text
    # with a grammar too: both masks hold (the grammar's tokens that are also allowed)
    r = served.post(route, {**base, "max_tokens": 8, "seed": 1, "return_token_ids": True,
                            "structured_outputs": {"regex": "[a-z]+"},
                            "allowed_token_ids": [served.llm.encode("a")[0],
                                                  served.llm.encode("b")[0]]})
    assert set(_ids(r)) <= {served.llm.encode("a")[0], served.llm.encode("b")[0]} | \
        set(served.llm.eos_token_ids), r.text


@pytest.mark.parametrize("bad", [[], [-1], [10**6], "x"])
def test_a_bad_allowed_token_ids_is_a_400(served, bad):
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                        "allowed_token_ids": bad})
    assert _err(r)[:2] == (400, "allowed_token_ids"), r.text


@pytest.mark.parametrize("bad", [["ok"] * 1025, ["x" * 257], [""], "word"])
def test_bad_words_beyond_the_caps_or_malformed_are_a_400(served, bad):
    """Each step of the request checks its bad words: their number and length are bounded."""
    r = served.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "bad_words": bad})
    assert _err(r)[:2] == (400, "bad_words"), r.text


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_words_never_appear_in_the_reply(served, route):
    """vLLM's bad_words: each word's token sequence (bare and after a space) is never
    completed. The words are taken from the greedy reply itself, one of them several tokens."""
    from engine.token_filters import bad_word_sequences
    llm = served.llm
    base = {"prompt": "Once upon a time"} if route == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "Once upon a time"}]}
    base.update(max_tokens=30, temperature=0, return_token_ids=True)
    plain = served.post(route, base)
    text = plain.json()["choices"][0].get("text") or \
        plain.json()["choices"][0]["message"]["content"]
    words = sorted({w.strip(".,!?\n") for w in text.split()} - {""}, key=len)
    many = next(w for w in reversed(words) if len(llm.encode(" " + w)) > 1)   # multi-token
    chosen = [words[-1], many, words[0]]
    seqs = bad_word_sequences(llm.tokenizer, chosen)
    assert any(_contains(_ids(plain), s) for s in seqs)       # the plain reply has them
    r = served.post(route, {**base, "bad_words": chosen})
    assert r.status_code == 200, r.text
    assert not any(_contains(_ids(r), s) for s in seqs), (chosen, r.text)
    assert _ids(r) != _ids(plain)


def test_bad_words_with_overlap_scheduling_match_serial_steps():
    """Under overlap scheduling the newest token is still on the device when the next step is
    prepared: a multi-token bad word's ban needs it, so the result equals the serial one and
    never holds the word."""
    from engine import LLM, SamplingParams
    from engine.token_filters import bad_word_sequences
    from api_served import DEMO
    outs, prompts = {}, ["Once upon a time", "The list:"]
    for overlap in (False, True):
        with LLM(DEMO, device="cpu", dtype="float32", num_kv_blocks=64,
                 async_scheduling=overlap) as llm:
            words = []
            for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30)):
                words += [w for w in o.text.split() if len(llm.encode(" " + w)) > 1][:3]
            seqs = [s for s in bad_word_sequences(llm.tokenizer, words) if len(s) > 1]
            got = [o.token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=30, bad_words=words))]
            assert not any(_contains(ids, s) for ids in got for s in seqs), (overlap, words)
            outs[overlap] = got
    assert outs[True] == outs[False]


def test_allowed_token_ids_beside_guided_rows_under_overlap_scheduling():
    """A guided row's mask is filled late under overlap scheduling (its newest token is still
    on the device): the allowed rows' static masks ride in the same late fill, and every row
    gets what the serial engine gives it."""
    from engine import LLM, SamplingParams
    from api_served import DEMO
    allowed = (5, 77, 300, 1024)
    params = [SamplingParams(seed=1, max_tokens=16, guided={"regex": "[a-z]{3,12}"}),
              SamplingParams(seed=2, max_tokens=16, allowed_token_ids=allowed,
                             ignore_eos=True),
              SamplingParams(seed=3, max_tokens=16, allowed_token_ids=allowed,
                             guided={"regex": "[a-z ]+"}),
              SamplingParams(seed=4, max_tokens=16)]
    outs = {}
    for overlap in (False, True):
        with LLM(DEMO, device="cpu", dtype="float32", num_kv_blocks=64,
                 async_scheduling=overlap) as llm:
            outs[overlap] = [o.token_ids for o in llm.generate(["a", "b", "c", "d"], params)]
            eos = set(llm.eos_token_ids)
    assert outs[True] == outs[False]
    assert set(outs[True][1]) <= set(allowed) and len(outs[True][1]) == 16
    assert set(outs[True][2]) <= set(allowed) | eos


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(served):
    llm = served.llm
    prompt = "Once upon a time"
    ref = _greedy(llm, prompt, 30).text
    stop = ref[10:14]
    base = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": [stop]}
    without = served.post("/v1/completions", base).json()["choices"][0]
    with_ = served.post("/v1/completions", {**base, "include_stop_str_in_output": True}
                        ).json()["choices"][0]
    assert with_["text"] == without["text"] + stop and with_["text"].endswith(stop)
    assert with_["finish_reason"] == "stop" and with_["stop_reason"] == stop
    chunks = _stream(served, "/v1/completions", {**base, "include_stop_str_in_output": True})
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == with_["text"]
    # a stop token id: its text ends the reply too
    ids = llm.encode(prompt)
    tok = _greedy(llm, ids, 6).token_ids[3]
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stop_token_ids": [tok]}
    a = served.post("/v1/completions", body).json()["choices"][0]
    b = served.post("/v1/completions", {**body, "include_stop_str_in_output": True}
                    ).json()["choices"][0]
    assert b["text"] == a["text"] + llm.tokenizer.decode([tok]) and b["stop_reason"] == tok


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(served):
    tok = served.llm.tokenizer
    special = tok.convert_tokens_to_ids("<|im_start|>")      # special, not an end of sequence
    assert special not in served.llm.eos_token_ids
    body = {"prompt": "hi", "max_tokens": 3, "allowed_token_ids": [special]}
    r = served.post("/v1/completions", body).json()["choices"][0]
    assert r["text"] == ""                                   # vLLM's default: skipped
    for spaces in (True, False):
        r = served.post("/v1/completions", {**body, "skip_special_tokens": False,
                                            "spaces_between_special_tokens": spaces})
        want = tok.decode([special] * 3, skip_special_tokens=False,
                          spaces_between_special_tokens=spaces)
        assert r.json()["choices"][0]["text"] == want == "<|im_start|>" * 3, r.text
    # an end-of-sequence token that ends the reply is not in the text (vLLM's rule)
    eos = sorted(served.llm.eos_token_ids)[0]
    r = served.post("/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                        "allowed_token_ids": [eos],
                                        "skip_special_tokens": False}).json()["choices"][0]
    assert r["text"] == "" and r["finish_reason"] == "stop"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(served, route):
    """vLLM's return_tokens_as_token_ids: each logprob token (and alternative) is the string
    `token_id:N`; the reply's text is unchanged."""
    chat = route == "/v1/chat/completions"
    base = {"max_tokens": 5, "temperature": 0, "return_token_ids": True, "logprobs": True,
            "top_logprobs": 2} if chat else \
        {"max_tokens": 5, "temperature": 0, "return_token_ids": True, "logprobs": 2}
    base.update({"messages": [{"role": "user", "content": "Hello"}]} if chat
                else {"prompt": "Hello"})
    plain = served.post(route, base).json()["choices"][0]
    for stream in (False, True):
        if stream:
            chunks = _stream(served, route, {**base, "return_tokens_as_token_ids": True})
            lps = [c["choices"][0]["logprobs"] for c in chunks
                   if c["choices"] and c["choices"][0].get("logprobs")]
        else:
            c = served.post(route, {**base, "return_tokens_as_token_ids": True}).json()
            lps = [c["choices"][0]["logprobs"]]
            text = c["choices"][0]["message"]["content"] if chat else c["choices"][0]["text"]
            assert text == (plain["message"]["content"] if chat else plain["text"])
        if chat:
            entries = [e for lp in lps for e in lp["content"]]
            names = [e["token"] for e in entries]
            alts = [a["token"] for e in entries for a in e["top_logprobs"]]
            assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
        else:
            names = [t for lp in lps for t in lp["tokens"]]
            alts = [t for lp in lps for top in lp["top_logprobs"] for t in top]
        assert names == [f"token_id:{t}" for t in plain["token_ids"]], stream
        assert alts and all(re.fullmatch(r"token_id:\d+", a) for a in alts)


# ---- chat echo and content parts -------------------------------------------------------------
def test_chat_echo_puts_the_last_message_first_when_it_is_the_replys_role(served):
    """vLLM: with echo, the last message's content is prepended when its role is the reply's
    (the assistant's; with add_generation_prompt false, the last message's own)."""
    llm = served.llm
    msgs = [{"role": "user", "content": "Tell me a story"},
            {"role": "assistant", "content": "Once upon"}]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = served.post("/v1/chat/completions", {**body, "echo": False}).json()
    r = served.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content == "Once upon" + plain["choices"][0]["message"]["content"]
    chunks = _stream(served, "/v1/chat/completions", body)
    streamed = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks
                       if c["choices"])
    assert streamed == content
    # the last message is the user's and the reply the assistant's: nothing to echo
    ask = {"messages": msgs[:1], "max_tokens": 4, "temperature": 0}
    assert served.post("/v1/chat/completions", {**ask, "echo": True}).json()["choices"] == \
        served.post("/v1/chat/completions", ask).json()["choices"]
    r = served.post("/v1/completions", {"prompt": "hi there", "echo": True, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi there")
    assert llm is served.llm


def test_text_content_parts_are_joined_with_newlines(served):
    parts = [{"type": "text", "text": "first line"}, {"type": "text", "text": "second"}]
    a = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}],
                                             "max_tokens": 1, "return_token_ids": True}).json()
    b = served.post("/v1/chat/completions", {"messages": [{"role": "user",
                                                           "content": "first line\nsecond"}],
                                             "max_tokens": 1, "return_token_ids": True}).json()
    assert a["prompt_token_ids"] == b["prompt_token_ids"]


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


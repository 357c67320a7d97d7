"""Several choices per request: a batch of prompts in /v1/completions (strings or token-id
lists) and n > 1 (the copies reuse the first one's prompt blocks through the prefix cache)."""
from __future__ import annotations

import json

import pytest


PROMPTS = ["The quick brown fox", "one two three four five six"]
LONG = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty")


def _greedy(llm, prompt, n=8):
    from engine import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0]


def _stream_texts(text: str) -> tuple[dict, list]:
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + (
                ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return texts, chunks


def test_a_batch_of_string_prompts_gives_one_choice_each_in_order(served):
    r = served.post("/v1/completions", {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for p, c in zip(PROMPTS, body["choices"]):
        assert c["text"] == _greedy(served.llm, p).text
    n_prompt = sum(len(served.llm.encode(p)) for p in PROMPTS)
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 16,
                             "total_tokens": n_prompt + 16}


def test_a_batch_of_token_id_prompts(served):
    ids = [served.llm.encode(p) for p in PROMPTS]
    body = served.post("/v1/completions", {"prompt": ids, "max_tokens": 8,
                                           "temperature": 0}).json()
    assert [c["text"] for c in body["choices"]] == [_greedy(served.llm, p).text for p in PROMPTS]


def test_the_openai_client_sends_a_batch(served):
    r = served.client().completions.create(model=served.model, prompt=PROMPTS, max_tokens=4,
                                           temperature=0)
    assert len(r.choices) == 2 and r.choices[1].text == _greedy(served.llm, PROMPTS[1], 4).text


def test_n_greedy_copies_are_equal_and_reuse_the_prompts_blocks(served):
    n_prompt = len(served.llm.encode(LONG))
    bs = served.llm.block_size
    full_blocks = (n_prompt - 1) // bs
    assert full_blocks >= 1
    before = served.llm.stats()["prefix_hits"]
    body = served.post("/v1/completions", {"prompt": LONG, "max_tokens": 6, "temperature": 0,
                                           "n": 3}).json()
    want = _greedy(served.llm, LONG, 6).text
    assert [c["text"] for c in body["choices"]] == [want] * 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    # the two copies found the first one's full prompt blocks in the prefix cache
    assert served.llm.stats()["prefix_hits"] - before >= 2 * full_blocks
    assert body["usage"]["prompt_tokens"] == n_prompt          # once per prompt
    assert body["usage"]["completion_tokens"] == 18


def test_n_seeded_samples_differ_and_repeat_with_the_seed(served):
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12,
            "temperature": 1.0, "seed": 7, "n": 4}
    a = served.post("/v1/chat/completions", body).json()
    b = served.post("/v1/chat/completions", body).json()
    texts = [c["message"]["content"] for c in a["choices"]]
    assert texts == [c["message"]["content"] for c in b["choices"]]
    assert len(set(texts)) > 1


def test_n_with_a_batch_numbers_choices_prompt_major(served):
    body = served.post("/v1/completions", {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0,
                                           "n": 2}).json()
    got = [(c["index"], c["text"]) for c in body["choices"]]
    w0, w1 = (_greedy(served.llm, p, 5).text for p in PROMPTS)
    assert got == [(0, w0), (1, w0), (2, w1), (3, w1)]


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_carry_their_index_and_match_the_unstreamed_reply(served, chat):
    base = ({"messages": [{"role": "user", "content": "hi there"}]} if chat
            else {"prompt": PROMPTS})
    body = {**base, "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 2}
    whole = served.post("/v1/chat/completions" if chat else "/v1/completions", body).json()
    r = served.post("/v1/chat/completions" if chat else "/v1/completions",
                    {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts, chunks = _stream_texts(r.text)
    want = {c["index"]: c["message"]["content"] if chat else c["text"] for c in whole["choices"]}
    assert texts == want
    finals = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"]
              if ch["finish_reason"]}
    assert finals == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"]


def test_an_empty_prompt_in_a_batch_is_a_400_naming_it(served):
    r = served.post("/v1/completions", {"prompt": ["fine", ""], "max_tokens": 2})
    assert r.status_code == 400 and "prompt[1]" in r.json()["error"]["message"]


def test_nothing_is_left_in_the_engine_after_many_choices(served):
    served.post("/v1/completions", {"prompt": PROMPTS, "max_tokens": 4, "n": 3})
    s = served.llm.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0

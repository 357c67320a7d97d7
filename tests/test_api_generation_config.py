"""The model card's sampling defaults (generation_config.json) apply when a request leaves a
field out, as vLLM's server does; a field the request sets wins."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from api_served import DEMO, ServedAPI


def _card(tmp_path, **gen) -> str:
    """The demo checkpoint with its generation_config.json replaced."""
    out = tmp_path / "card"
    out.mkdir()
    for f in os.listdir(DEMO):
        if f != "generation_config.json":
            shutil.copy(os.path.join(DEMO, f), out / f)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], **gen}))
    return str(out)


def test_read_defaults_takes_vllms_keys_only(tmp_path):
    from api.generation_config import read_defaults
    path = _card(tmp_path, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                 max_new_tokens=33, do_sample=True, min_p=0, typical_p=0.5)
    assert read_defaults(path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                   "repetition_penalty": 1.05, "max_tokens": 33, "min_p": 0.0}
    assert read_defaults(str(tmp_path / "nowhere")) == {}
    (tmp_path / "card" / "generation_config.json").write_text("{broken")
    assert read_defaults(path) == {}                    # logged, never fatal


def test_a_field_left_out_takes_the_cards_value_and_a_set_one_wins():
    from api.protocol import ChatCompletionRequest, CompletionRequest
    from api.sampling import sampling_params
    card = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "max_tokens": 33,
            "repetition_penalty": 1.05}
    left_out = CompletionRequest(prompt="hi")
    p = sampling_params(left_out, 512, 2, card)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.8, 20, 0.05)
    assert p.repetition_penalty == 1.05
    assert p.max_tokens == 16           # completions: OpenAI's 16 is below the card's 33
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert sampling_params(chat, 512, 2, card).max_tokens == 33
    set_ = CompletionRequest(prompt="hi", temperature=0, top_p=1, top_k=-1, min_p=0,
                             max_tokens=5)
    p = sampling_params(set_, 512, 2, card)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.0, 1.0, 0, 0.0, 5)
    nulls = CompletionRequest.model_validate({"prompt": "hi", "temperature": None})
    assert sampling_params(nulls, 512, 2, card).temperature == 0.7      # null = left out
    plain = sampling_params(CompletionRequest(prompt="hi"), 512, 2, {})
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)     # OpenAI's


@pytest.fixture
def greedy_card(tmp_path):
    s = ServedAPI(_card(tmp_path, temperature=0.0), num_kv_blocks=32)
    yield s
    s.close()


def test_a_greedy_card_makes_requests_without_temperature_greedy(greedy_card):
    from engine import SamplingParams
    s = greedy_card
    want = s.llm.generate(["The quick brown fox"], SamplingParams(temperature=0,
                                                                  max_tokens=10))[0].text
    for seed in (1, 2):
        r = s.post("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 10,
                                       "seed": seed})
        assert r.json()["choices"][0]["text"] == want
    hot = [s.post("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 10,
                                      "seed": seed, "temperature": 1.5}).json()
           ["choices"][0]["text"] for seed in (1, 2, 3)]
    assert any(t != want for t in hot)          # the request's own temperature wins

"""`"interventions"` in /v1/completions and /v1/chat/completions bodies: the same edit as the
Python API, and a 400 naming the bad field before anything runs."""
from __future__ import annotations

import pytest

from engine import LLM, Intervention, SamplingParams


@pytest.fixture(scope="module")
def api(model_factory):
    from fastapi.testclient import TestClient

    from api.server import create_app
    llm = LLM(model_factory("qwen3"), device="cpu", num_kv_blocks=64, block_size=4)
    # the Host allow-list (api/guard.py) answers localhost names only
    with TestClient(create_app(llm), base_url="http://localhost") as client:
        yield llm, client
    llm.shutdown()


ABLATE = {"kind": "ablate_heads", "layer": 1, "heads": [0, 3]}


def test_completions_apply_the_interventions_like_generate(api):
    llm, client = api
    prompt = "the quick brown fox"
    steer = {"kind": "steer", "layer": 0, "vector": [0.5] * 64, "scale": 3.0,
             "positions": "generated"}
    body = {"model": llm.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "interventions": [ABLATE, steer]})
    assert r.status_code == 200, r.text
    ivs = [Intervention.ablate_heads(1, [0, 3]), Intervention.steer(0, [0.5] * 64, 3.0, "generated")]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(prompt, params, interventions=ivs)[0].text
    plain = llm.generate(prompt, params)[0].text
    assert r.json()["choices"][0]["text"] == want
    assert want != plain, "the edit changed nothing: the test proves nothing"


def test_chat_completions_accept_interventions(api):
    llm, client = api
    msgs = [{"role": "user", "content": "hello world"}]
    body = {"model": llm.model_name, "messages": msgs, "max_tokens": 5, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**body, "interventions": [ABLATE]})
    assert r.status_code == 200, r.text
    want = llm.generate([msgs], SamplingParams(temperature=0, max_tokens=5),
                        interventions=[Intervention.ablate_heads(1, [0, 3])])[0].text
    assert r.json()["choices"][0]["message"]["content"] == want


@pytest.mark.parametrize("iv,param,words", [
    ({"kind": "ablate_heads", "layer": 7, "heads": [0]}, "interventions[0].layer", "out of range"),
    ({"kind": "ablate_heads", "layer": 0, "heads": [9]}, "interventions[0].heads", "attention heads"),
    ({"kind": "ablate_heads", "layer": 0}, "interventions[0].heads", "needs the field"),
    ({"kind": "mask_experts", "layer": 0, "experts": [1]}, "interventions[0].experts", "not a MoE"),
    ({"kind": "steer", "layer": 0, "vector": [1.0, 2.0]}, "interventions[0].vector", "hidden_size"),
    ({"kind": "steer", "layer": 0, "vector": [1.0] * 64, "positions": "end"},
     "interventions[0].positions", "positions"),
    ({"kind": "zap", "layer": 0}, "interventions[0].kind", "kind"),
    # issue #48.1: past int64, and past the model's context (positions the engine never sees)
    ({"kind": "clamp_attention", "layer": 0, "heads": [0], "positions": [2 ** 63]},
     "interventions[0].positions", "positions"),
    ({"kind": "clamp_attention", "layer": 0, "heads": [0], "positions": [0, 10 ** 6]},
     "interventions[0].positions", "max_model_len"),
    ({"kind": "ablate_heads", "layer": 0, "heads": [0], "head": 1}, "interventions[0].head", "unknown"),
])
def test_bad_interventions_are_400s_naming_the_field(api, iv, param, words):
    llm, client = api
    for path, extra in (("/v1/completions", {"prompt": "hello"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={"model": llm.model_name, "max_tokens": 2, **extra,
                                    "interventions": [iv]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err

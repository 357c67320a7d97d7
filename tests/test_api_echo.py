"""echo with prompt logprobs (lm-eval-harness' loglikelihood request: `echo: true, logprobs: 1,
max_tokens: 1` on token-id prompts) and vLLM's `prompt_logprobs`, exact against HF's forward
of the demo checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from api_served import DEMO

CONTEXT = "The quick brown fox"
CONTINUATIONS = [" jumps over the lazy dog", " widget is that"]


@pytest.fixture(scope="module")
def hf():
    from tiny_models import load_hf
    return load_hf(DEMO)


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_lm_evals_loglikelihood_request_scores_continuations_like_hf(served, hf):
    tok = served.llm.tokenizer
    ctx = tok.encode(CONTEXT)
    items = [ctx + tok.encode(c) for c in CONTINUATIONS]
    # the exact payload lm-eval's local-completions sends for loglikelihood requests
    payload = {"model": served.model, "prompt": items, "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    body = served.post("/v1/completions", payload).json()
    for choice, ids in zip(sorted(body["choices"], key=lambda c: c["index"]), items):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1               # the prompt, then one new token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = _hf_logprobs(hf, ids)
        for i in range(1, len(ids)):
            assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-4
            top_tok, top_val = next(iter(lp["top_logprobs"][i].items()))
            assert abs(top_val - ref[i - 1].max().item()) < 1e-4
            assert top_tok == served.llm.tokenizer.decode([int(ref[i - 1].argmax())])
        # lm-eval's parse: continuation logprob and greediness from [ctxlen:-1]
        ctxlen = len(ctx)
        cont = lp["token_logprobs"][ctxlen:-1]
        want = sum(ref[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
        assert abs(sum(cont) - want) < 1e-3
        greedy = all(t == max(top.values()) for t, top in
                     zip(cont, lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))
        assert choice["text"].startswith(tok.decode(ids))


def test_echo_text_is_the_prompt_then_the_reply(served):
    body = served.post("/v1/completions", {"prompt": CONTEXT, "max_tokens": 5,
                                           "temperature": 0, "echo": True}).json()
    plain = served.post("/v1/completions", {"prompt": CONTEXT, "max_tokens": 5,
                                            "temperature": 0}).json()
    assert body["choices"][0]["text"] == CONTEXT + plain["choices"][0]["text"]
    assert body["choices"][0]["logprobs"] is None


def test_echo_with_max_tokens_0_returns_the_prompt_alone(served):
    body = served.post("/v1/completions", {"prompt": CONTEXT, "max_tokens": 0, "echo": True,
                                           "logprobs": 2}).json()
    c = body["choices"][0]
    n = len(served.llm.encode(CONTEXT))
    assert c["text"] == CONTEXT and len(c["logprobs"]["tokens"]) == n
    assert body["usage"]["completion_tokens"] == 0 and c["finish_reason"] == "length"
    assert all(len(t) == 2 for t in c["logprobs"]["top_logprobs"][1:])
    r = served.post("/v1/completions", {"prompt": CONTEXT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_equals_the_whole_reply(served):
    req = {"prompt": [CONTEXT, "one two three"], "max_tokens": 4, "temperature": 0,
           "echo": True, "logprobs": 1}
    whole = served.post("/v1/completions", req).json()
    r = served.post("/v1/completions", {**req, "stream": True})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    for c in whole["choices"]:
        mine = [ch for k in chunks for ch in k["choices"] if ch["index"] == c["index"]]
        assert "".join(ch["text"] for ch in mine) == c["text"]
        got = [v for ch in mine if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
        want = c["logprobs"]["token_logprobs"]
        assert got[0] is None and want[0] is None and len(got) == len(want)
        # the batches may differ between the two runs: fp32 rounding, not a different value
        assert got[1:] == pytest.approx(want[1:], abs=1e-4)


def test_prompt_logprobs_in_vllms_shape(served, hf):
    ids = served.llm.encode(CONTEXT)
    ref = _hf_logprobs(hf, ids)
    body = served.post("/v1/completions", {"prompt": CONTEXT, "max_tokens": 2,
                                           "prompt_logprobs": 2}).json()
    pl = body["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for i in range(1, len(ids)):
        mine = pl[i][str(ids[i])]
        assert abs(mine["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        assert mine["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert mine["decoded_token"] == served.llm.tokenizer.decode([ids[i]])
        assert 2 <= len(pl[i]) <= 3
    chat = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "prompt_logprobs": 0}).json()
    n = len(served.llm.encode([{"role": "user", "content": "hi"}]))
    assert len(chat["prompt_logprobs"]) == n and chat["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in served.post("/v1/completions", {
        "prompt": CONTEXT, "max_tokens": 1}).json()["choices"][0]

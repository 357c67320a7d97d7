"""The operations routes with vLLM's paths and shapes: /health, /version, /metrics (read back
with prometheus_client's own text parser), /tokenize, /detokenize."""
from __future__ import annotations

import httpx
import pytest

from api_served import ServedAPI


@pytest.fixture(scope="module")
def served():
    from api.routes import EngineHolder
    s = ServedAPI(engines=EngineHolder(None))
    yield s
    s.close()


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, name: str, sample: str | None = None, default=None, **labels) -> float:
    fam = fams[name]
    for s in fam.samples:
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    if default is not None:
        return default
    raise KeyError(f"{sample or name} {labels} not in {fam.samples}")


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/ping"),
                                          ("POST", "/ping")])     # /ping: vLLM's (SageMaker's)
def test_health_is_200_when_serving_and_503_while_switching(served, method, path):
    r = httpx.request(method, served.url + path)        # no key needed, as vLLM's
    assert r.status_code == 200
    served.engines.switching = True
    try:
        r = httpx.request(method, served.url + path)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_switching"
    finally:
        served.engines.switching = False


def test_health_is_503_once_the_engine_is_shut_down():
    from api.routes import EngineHolder
    s = ServedAPI(engines=EngineHolder(None), num_kv_blocks=16)
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        s.llm.shutdown()
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        s.close()


def test_version_answers_without_a_key(served):
    r = httpx.get(served.url + "/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)


def test_metrics_parse_and_count_requests_tokens_and_latencies(served):
    before = _families(httpx.get(served.url + "/metrics", headers=served.headers).text)
    model = served.model
    n_before = _value(before, "vllm:generation_tokens", "vllm:generation_tokens_total",
                      default=0.0, model_name=model)
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    n_prompt = len(served.llm.encode(prompt))
    for _ in range(2):      # the second one reuses the first one's full prompt blocks
        r = served.post("/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                            "ignore_eos": True})
        assert r.status_code == 200
    resp = httpx.get(served.url + "/metrics", headers=served.headers)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    fams = _families(resp.text)
    assert _value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total",
                  model_name=model) == n_before + 10
    assert _value(fams, "vllm:request_success", "vllm:request_success_total",
                  model_name=model, finished_reason="length") >= 2
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:time_per_output_token_seconds"):
        assert fams[h].type == "histogram"
        assert _value(fams, h, h + "_count", model_name=model) >= 2
        assert _value(fams, h, h + "_sum", model_name=model) > 0
    assert _value(fams, "vllm:num_requests_running", model_name=model) == 0
    assert _value(fams, "vllm:num_requests_waiting", model_name=model) == 0
    usage = _value(fams, "vllm:kv_cache_usage_perc", model_name=model)
    assert 0 <= usage <= 1 and usage == _value(fams, "vllm:gpu_cache_usage_perc",
                                               model_name=model)
    bs = served.llm.block_size
    hits = _value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total",
                  model_name=model)
    assert hits >= ((n_prompt - 1) // bs) * bs > 0
    assert _value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total",
                  model_name=model) >= hits
    assert _value(fams, "vllm:num_preemptions", "vllm:num_preemptions_total",
                  model_name=model) == 0
    assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total",
                  model_name=model) >= 2 * n_prompt


def _count(fams, name, model) -> float:
    return _value(fams, name, name + "_count", default=0.0, model_name=model)


def _sum(fams, name, model) -> float:
    return _value(fams, name, name + "_sum", default=0.0, model_name=model)


PHASES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds")


def test_metrics_phase_inter_token_and_iteration_histograms_count_every_request(served):
    """vLLM's request-phase, inter-token and per-step histograms, for the API's requests and
    for ones made on the engine directly (the playground's chat): no tab needs to be open."""
    import random

    from engine import SamplingParams
    model, llm = served.model, served.llm
    scrape = lambda: _families(httpx.get(served.url + "/metrics",          # noqa: E731
                                         headers=served.headers).text)
    before = scrape()
    rng = random.Random(4049)     # fresh prompts: no prefix-cache hit, every token computed
    p1 = [rng.randrange(100, 4000) for _ in range(21)]
    p2 = [rng.randrange(100, 4000) for _ in range(13)]
    r = served.post("/v1/completions", {"prompt": p1, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    llm.generate([p2], SamplingParams(max_tokens=7, ignore_eos=True))
    after = scrape()
    for h in PHASES + ("vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total"):
        assert after[h].type == "histogram", h
    for h in PHASES:
        assert _count(after, h, model) == _count(before, h, model) + 2, h
    for h in PHASES[1:]:
        assert _sum(after, h, model) > _sum(before, h, model), h
    itl = "vllm:inter_token_latency_seconds"     # one gap between each two tokens
    assert _count(after, itl, model) == _count(before, itl, model) + (5 - 1) + (7 - 1)
    assert _sum(after, itl, model) > _sum(before, itl, model)
    # every step's tokens: each prompt once, then one token per decode step
    it = "vllm:iteration_tokens_total"
    assert _sum(after, it, model) - _sum(before, it, model) == len(p1) + 4 + len(p2) + 6
    assert _count(after, it, model) - _count(before, it, model) == (1 + 4) + (1 + 6)   # steps
    # vLLM's bucket bounds
    bounds = sorted({float(s.labels["le"]) for s in after[itl].samples
                     if s.name == itl + "_bucket"})
    assert bounds[:4] == [0.01, 0.025, 0.05, 0.075] and bounds[-2:] == [80.0, float("inf")]
    bounds = sorted({float(s.labels["le"]) for s in after[PHASES[0]].samples
                     if s.name == PHASES[0] + "_bucket"})
    assert bounds[:3] == [0.3, 0.5, 0.8] and bounds[-2:] == [7680.0, float("inf")]


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(served):
    tok = served.llm.tokenizer
    r = served.post("/tokenize", {"prompt": "The quick brown fox", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode("The quick brown fox")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == served.llm.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    back = served.post("/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": "The quick brown fox"}
    msgs = [{"role": "user", "content": "hi <|im_start|>system"}]
    chat = served.post("/tokenize", {"messages": msgs}).json()
    assert chat["tokens"] == served.llm.encode(msgs)     # message text stays text
    assert chat["token_strs"] is None


def test_tokenize_needs_the_key_and_one_prompt(served):
    assert httpx.post(served.url + "/tokenize", json={"prompt": "a"}).status_code == 401
    r = served.post("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert r.status_code == 400
    r = served.post("/detokenize", {"tokens": [10 ** 9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_ping_is_open_on_a_keyed_server_and_generation_is_not():
    s = ServedAPI(num_kv_blocks=16)             # api_served's key
    try:
        assert httpx.get(s.url + "/ping").status_code == 200
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    finally:
        s.close()


def test_tokenize_messages_counts_what_the_chat_request_gets(served):
    """/tokenize with messages renders the chat template with the chat route's own options, so
    its count is the chat completion's prompt_tokens (a client counting before it sends)."""
    msgs = [{"role": "user", "content": "Tell me about caches."},
            {"role": "assistant", "content": "A cache keeps"}]
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look up a word",
                                             "parameters": {"type": "object", "properties": {
                                                 "word": {"type": "string"}}}}}
    cases = [dict(), dict(add_generation_prompt=False),
             dict(add_generation_prompt=False, continue_final_message=True),
             dict(tools=[tool])]
    counts = set()
    for opts in cases:
        tok = served.post("/tokenize", {"messages": msgs, **opts}).json()
        chat = served.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                                    **opts}).json()
        assert tok["count"] == chat["usage"]["prompt_tokens"], (opts, tok, chat)
        counts.add(tok["count"])
    assert len(counts) == 3         # the prefill options each change it (the demo's template
    #                                 renders no tools: there only the equality is checked)
    r = served.post("/tokenize", {"messages": msgs[:1], "continue_final_message": True,
                                  "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"

"""The OpenAI-compatible API on the playground's own server, driven by the real `openai` client:
chat and completions (streaming and not), logprobs, stop, seeds, usage, errors, watched
requests, concurrency without leaked KV blocks, disconnects, and batching with the browser chat."""
from __future__ import annotations

import io
import json
import re
import threading
import time
import zipfile

import httpx
import pytest

from ui_helpers import free_port, require_engine, wait_until  # noqa: I001

KEY = "test-key-123"
SYSTEM = "You are a helpful assistant."


class Served:
    def __init__(self):
        import os
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
        import app
        from engine import LLM
        model, _ = app.resolve_model(None)
        self.llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=128, block_size=16)
        self.demo = app.build_app(self.llm)
        self.port = free_port()
        app.launch(self.demo, port=self.port, prevent_thread_lock=True, api_key=KEY)
        self.url = f"http://127.0.0.1:{self.port}/"
        self.model = self.llm.model_name

    def client(self, key: str = KEY):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "v1", api_key=key, max_retries=0, timeout=60)

    def close(self):
        self.demo.close()
        self.llm.shutdown()


@pytest.fixture(scope="module")
def served():
    require_engine()
    s = Served()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def _msgs(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def _generate(llm, prompt, **kw):
    from engine import SamplingParams
    return llm.generate([prompt], SamplingParams(**kw))[0]


def _no_blocks_held(llm) -> bool:
    snap = llm.inspect()
    return not snap.running and not snap.waiting and not any(b.owners for b in snap.blocks)


# ---- models ----------------------------------------------------------------------------------
def test_models_lists_the_served_model(served, client):
    models = client.models.list().data
    assert [m.id for m in models] == [served.model]
    assert models[0].owned_by == "glassbox"
    assert client.models.retrieve(served.model).id == served.model


# ---- chat ------------------------------------------------------------------------------------
def test_greedy_chat_equals_llm_generate_with_usage_counts(served, client):
    msgs = _msgs("Tell me a story about a small robot.")
    ref = _generate(served.llm, msgs, temperature=0, max_tokens=24)
    r = client.chat.completions.create(model=served.model, messages=msgs, temperature=0,
                                       max_tokens=24)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == served.model and abs(r.created - time.time()) < 60
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_is_the_same_reply_in_chunks_with_usage_last(served, client):
    msgs = _msgs("Name three colours and say why you like them.")
    ref = _generate(served.llm, msgs, temperature=0, max_tokens=32, ignore_eos=True)
    chunks = list(client.chat.completions.create(
        model=served.model, messages=msgs, temperature=0, max_completion_tokens=32,
        extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert len(body) > 10                                   # token by token, not one blob
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_match_the_engine_and_name_the_tokens(served, client):
    msgs = _msgs("What is a KV cache?")
    ref = _generate(served.llm, msgs, temperature=0, max_tokens=12, logprobs=3)
    r = client.chat.completions.create(model=served.model, messages=msgs, temperature=0,
                                       max_tokens=12, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(ref.token_ids)
    tok = served.llm.tokenizer
    for entry, lp in zip(content, ref.logprobs):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(lp.top.values()),
                                                                       abs=1e-4)
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert entry.token == tok.decode([lp.token_id])
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == \
        r.choices[0].message.content or r.choices[0].finish_reason == "stop"


def test_a_stop_string_ends_the_reply_before_it(served, client):
    msgs = _msgs("Tell me a long story about a small robot who learns to paint.")
    full = client.chat.completions.create(model=served.model, messages=msgs, temperature=0,
                                          max_tokens=40, extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) > 6, text
    stop = " " + words[5]
    cut = text[:text.index(stop)]
    r = client.chat.completions.create(model=served.model, messages=msgs, temperature=0,
                                       max_tokens=40, stop=[stop, "never-appears-xyz"],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=served.model, messages=msgs, temperature=0,
                                              max_tokens=40, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_the_same_seed_gives_the_same_sampled_text(served, client):
    def sample(seed):
        return client.chat.completions.create(
            model=served.model, messages=_msgs("Write a poem about the sea."), temperature=1.0,
            top_p=0.95, max_tokens=24, seed=seed,
            extra_body={"ignore_eos": True}).choices[0].message.content
    a = sample(1234)
    assert sample(1234) == a
    assert any(sample(s) != a for s in (1, 2))


# ---- completions ----------------------------------------------------------------------------
def test_completions_from_text_and_from_token_ids_equal_llm_generate(served, client):
    prompt = "Once upon a time, a small robot"
    ref = _generate(served.llm, prompt, temperature=0, max_tokens=16, ignore_eos=True)
    r = client.completions.create(model=served.model, prompt=prompt, temperature=0,
                                  max_tokens=16, extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 16)
    ids = client.completions.create(model=served.model, prompt=ref.prompt_token_ids,
                                    temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == ref.text
    stream = list(client.completions.create(model=served.model, prompt=prompt, temperature=0,
                                            max_tokens=16, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in stream) == ref.text
    assert stream[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_list_every_token_with_its_offset(served, client):
    r = client.completions.create(model=served.model, prompt="The glass box", temperature=0,
                                  max_tokens=10, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v, abs=1e-5)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(10)]


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=65), "n"),
    (dict(stop=[""]), "stop"),
    (dict(top_logprobs=3), "top_logprobs"),            # needs logprobs=true
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(logit_bias={"999999": 5}), "logit_bias"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
])
def test_a_bad_parameter_is_a_400_that_names_it(served, client, kwargs, param):
    import openai
    kw = dict(model=served.model, messages=_msgs("hi"), max_tokens=4)
    kw.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and "Traceback" not in err["message"]


def test_an_unknown_model_is_a_404(client):
    import openai
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-7", messages=_msgs("hi"), max_tokens=4)
    assert e.value.body["code"] == "model_not_found" and "gpt-7" in e.value.body["message"]


def test_a_prompt_too_long_is_a_400_that_says_so(served, client):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=served.model, prompt=" ".join(["word"] * 3000),
                                  max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["param"] == "prompt" and "max_model_len" in e.value.body["message"]


def test_a_wrong_api_key_is_a_401(served):
    import openai
    with pytest.raises(openai.AuthenticationError) as e:
        served.client("wrong-key").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_a_missing_api_key_is_a_401_that_says_how_to_send_it(served):
    r = httpx.post(served.url + "v1/completions", json={"model": served.model, "prompt": "hi"})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    # the key guards the playground too (api.guard): a browser is sent to the login page
    assert httpx.get(served.url).status_code == 401
    assert httpx.get(served.url, headers={"Accept": "text/html"}).headers["location"] \
        .startswith("/login")
    assert httpx.get(served.url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_broken_json_is_a_400_in_openais_error_shape(served):
    r = httpx.post(served.url + "v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_api_answers_503_while_the_model_switches(served, client):
    import openai
    served.demo.hub.switching = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=served.model, messages=_msgs("hi"),
                                           max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "model_switching"
    finally:
        served.demo.hub.switching = False


def test_ops_routes_answer_on_the_playgrounds_server(served):
    from prometheus_client.parser import text_string_to_metric_families
    assert httpx.get(served.url + "health").status_code == 200
    names = {f.name for f in text_string_to_metric_families(
        httpx.get(served.url + "metrics", headers={"Authorization": f"Bearer {KEY}"}).text)}
    assert httpx.get(served.url + "metrics").status_code == 401   # keyed server: keyed counters
    assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds"} <= names
    served.demo.hub.switching = True
    try:
        assert httpx.get(served.url + "health").status_code == 503
    finally:
        served.demo.hub.switching = False


# ---- watched requests ------------------------------------------------------------------------
def test_a_watched_request_has_a_trace_the_client_can_export(served, client, tmp_path):
    from engine import RequestTrace
    r = client.chat.completions.create(model=served.model, messages=_msgs("Hello there!"),
                                       temperature=0, max_tokens=8,
                                       extra_body={"glassbox": {"watch": True}})
    g = r.model_extra["glassbox"]
    assert g["watched"] and g["trace_id"] == r.id
    assert r.id in served.llm.traced_requests()
    trace = served.llm.trace(r.id)
    assert len(trace.output_token_ids) == r.usage.completion_tokens
    resp = httpx.get(served.url.rstrip("/") + g["trace_url"],
                     headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200
    zipfile.ZipFile(io.BytesIO(resp.content)).extractall(tmp_path)
    back = RequestTrace.load(tmp_path / f"{r.id}.npz")
    assert back.output_token_ids == trace.output_token_ids
    # an unwatched request has no trace: 404 naming why
    plain = client.completions.create(model=served.model, prompt="hi", max_tokens=2)
    assert not plain.model_extra["glassbox"]["watched"]
    miss = httpx.get(f"{served.url}v1/glassbox/traces/{plain.id}",
                     headers={"Authorization": f"Bearer {KEY}"})
    assert miss.status_code == 404 and miss.json()["error"]["code"] == "trace_not_found"


# ---- concurrency, disconnects, batching ------------------------------------------------------
def test_eight_concurrent_streaming_clients_complete_without_leaking_blocks(served):
    deadline = time.time() + 6
    done: dict[int, list] = {i: [] for i in range(8)}
    errors: list[BaseException] = []

    def worker(i):
        c = served.client()
        n = 0
        try:
            while time.time() < deadline:
                max_tokens = 8 + (i * 5 + n * 3) % 24
                chunks = list(c.chat.completions.create(
                    model=served.model, messages=_msgs(f"Client {i}, request {n}: count."),
                    temperature=0.8, seed=i * 100 + n, max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
                done[i].append((max_tokens, chunks))
                n += 1
        except BaseException as e:      # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(done[i] for i in range(8)), {i: len(v) for i, v in done.items()}
    for runs in done.values():
        for max_tokens, chunks in runs:
            body = [c for c in chunks if c.choices]
            assert body[-1].choices[0].finish_reason == "length"
            assert chunks[-1].usage.completion_tokens == max_tokens      # nothing lost
    llm = served.llm
    wait_until(lambda: _no_blocks_held(llm), timeout=10)
    with llm.loop.lock:
        llm.block_manager.check_invariants([])


def test_streams_need_no_thread_per_request(served):
    """32 streams at once: the engine thread hands events to the loop; a thread per request
    (the old design) starved the engine loop of the GIL under load."""
    import asyncio
    import os

    from api.streaming import EngineStream, LoopWaker
    from engine import SamplingParams
    llm = served.llm
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main():
        before = threading.active_count()
        streams = [EngineStream(llm, llm.process(f"Stream {i}: count.", params,
                                                 request_id=f"threads-{i}"))
                   for i in range(32)]
        peak, tokens = before, []

        async def consume(s):
            nonlocal peak
            n = 0
            async for items in s.batches():
                peak = max(peak, threading.active_count())
                n += sum(1 for ev in items if ev.token_id is not None)
            tokens.append(n)
        await asyncio.gather(*(consume(s) for s in streams))
        waker = LoopWaker.of(asyncio.get_running_loop())
        assert waker.active == 0, "ended streams still count as load for the stream interval"
        return before, peak, tokens

    before, peak, tokens = asyncio.run(main())
    assert tokens == [24] * 32
    pool = min(32, (os.cpu_count() or 1) + 4)          # asyncio's default executor, at most
    assert peak - before <= pool, f"{peak - before} threads for 32 streams"
    wait_until(lambda: _no_blocks_held(llm), timeout=10)


def test_the_stream_interval_grows_with_the_load_and_is_capped():
    import asyncio

    from api.streaming import LoopWaker
    w = LoopWaker(asyncio.new_event_loop())
    assert w.interval() == 0
    for _ in range(8):
        w.opened()
    assert 0 < w.interval() <= 0.005            # a few streams: every token, within ms
    for _ in range(1000):
        w.opened()
    assert w.interval() == LoopWaker.MAX_INTERVAL_S
    w.loop.close()


def test_closing_a_stream_midway_aborts_it_and_frees_its_blocks(served):
    c = served.client()
    stream = c.chat.completions.create(model=served.model, messages=_msgs("Tell a long tale."),
                                       temperature=0.8, max_tokens=450, stream=True,
                                       extra_body={"ignore_eos": True})
    rid = None
    for i, chunk in enumerate(stream):
        rid = chunk.id
        if i == 3:
            break
    assert rid in served.llm.inspect().block_tables          # it holds blocks now
    stream.close()
    t0 = time.time()
    wait_until(lambda: rid not in served.llm.inspect().block_tables, timeout=5, interval=0.05)
    freed_after = time.time() - t0
    snap = served.llm.inspect()
    assert rid not in snap.running and rid not in snap.waiting
    assert not any(rid in b.owners for b in snap.blocks)
    decoded = sum(1 for s in snap.steps for e in s.entries if e.request_id == rid)
    assert decoded < 100, decoded            # aborted, not run to its 450 tokens
    assert freed_after < 3


def test_a_client_that_gives_up_on_a_non_streamed_reply_aborts_it(served):
    body = {"model": served.model, "messages": _msgs("Tell a very long tale."),
            "max_tokens": 460, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "v1/chat/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {KEY}"})
    wait_until(lambda: _no_blocks_held(served.llm), timeout=5, interval=0.05)
    per_request: dict[str, int] = {}
    for step in served.llm.inspect().steps:
        for e in step.entries:
            per_request[e.request_id] = per_request.get(e.request_id, 0) + 1
    newest = max((r for r in per_request if r.startswith("chatcmpl-")),
                 key=lambda r: int(r.rsplit("-", 1)[1]))
    assert per_request[newest] < 200, per_request[newest]    # cut short, not 460 tokens


def test_api_and_browser_chat_requests_batch_in_the_same_steps(served, client):
    from gradio_client import Client
    gc = Client(served.url, verbose=False, headers={"Authorization": f"Bearer {KEY}"})
    start = threading.Barrier(2)
    out: dict[str, object] = {}

    def browser():
        start.wait()
        out["ui"] = list(gc.submit("Count to twenty.", SYSTEM, 0.7, 100, True, api_name="/chat"))

    def api():
        start.wait()
        out["api"] = list(client.chat.completions.create(
            model=served.model, messages=_msgs("Count to thirty."), temperature=0.7,
            max_tokens=100, stream=True, extra_body={"ignore_eos": True}))

    threads = [threading.Thread(target=f) for f in (browser, api)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert out.get("ui") and out.get("api")
    api_id = out["api"][0].id
    mixed = [s for s in served.llm.inspect().steps
             if any(e.request_id == api_id for e in s.entries)
             and any(re.fullmatch(r"chat-[0-9a-f]+-\d+", e.request_id) for e in s.entries)]
    assert mixed, "no step held both the API request and the browser chat's"


# ---- the pieces without a server -------------------------------------------------------------
def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch):
    from api import API_KEY_ENV, resolve_api_key
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-flag") == "from-flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key(None) is None and resolve_api_key("") is None


def test_serving_beyond_loopback_without_a_key_warns():
    from api import exposure_warning
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("localhost", None) is None
    assert "--api-key" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("0.0.0.0", "k") is None
    assert "share" in exposure_warning("127.0.0.1", None, share=True)


def test_validation_locations_become_openai_param_names():
    from api.errors import param_of
    assert param_of(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert param_of(("body", "prompt", "list[int]", 2)) == "prompt[2]"
    assert param_of(("body", "temperature")) == "temperature"
    assert json.dumps(param_of(("body",))) == "null"

"""A hostile and careless client against the playground's server (localhost only, bounded):
every attack of issue #29 runs while 4 background API streams decode on the dense demo, and

- each case gets a clear 4xx in OpenAI's shape (or a clear error event on Gradio's API), or a
  correct answer;
- nothing runs without the key: no request reaches the engine from an unauthenticated call;
- the background streams never wait more than 1 s between two tokens (gaps measured per
  stream, not the test's total time);
- afterwards every KV block is free, and threads and RSS are back near the warm baseline.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from ui_helpers import free_port, require_engine, wait_until  # noqa: I001

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo-qwen3"
KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_GAP_S = 1.0
STREAMS = 4


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024


class Server:
    """The playground (Gradio + API) on a free localhost port, with a key."""

    def __init__(self):
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
        import app
        from engine import LLM
        self.llm = LLM(str(DEMO), device="cpu", dtype="float32", num_kv_blocks=192,
                       block_size=16)
        self.demo = app.build_app(self.llm, choices=app.demo_choices())
        self.hub = self.demo.hub
        self.port = free_port()
        app.launch(self.demo, port=self.port, prevent_thread_lock=True, api_key=KEY)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = self.llm.model_name

    def post(self, path: str, body, timeout: float = 60, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={**AUTH, **kw.pop("headers", {})},
                          timeout=timeout, **kw)

    def healthy(self) -> bool:
        return httpx.get(self.url + "/health", timeout=10).status_code == 200

    def close(self):
        self.demo.close()
        self.hub.shutdown()


@pytest.fixture(scope="module")
def server():
    require_engine()
    if not (DEMO / "config.json").exists():
        pytest.skip("needs assets/demo-qwen3")
    s = Server()
    yield s
    s.close()


class Background:
    """STREAMS API streams that restart when they end, recording every gap between two
    content chunks of one stream."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.gaps: list[tuple[float, float]] = []     # (gap s, when it ended, monotonic)
        self.tokens = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True,
                                         name=f"bg-stream-{i}") for i in range(STREAMS)]

    def start(self):
        for t in self.threads:
            t.start()
        wait_until(lambda: self.tokens > 20 * STREAMS, timeout=60)

    def run(self, i: int):
        # logprobs: every token is a chunk, even one whose text is empty (a special token
        # after an ignored EOS), so a gap between chunks is a gap between tokens
        body = {"model": self.model, "stream": True, "max_tokens": 300, "ignore_eos": True,
                "temperature": 0, "logprobs": True,
                "messages": [{"role": "user", "content": f"Count: {i}"}]}
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                try:
                    with c.stream("POST", self.url + "/v1/chat/completions", json=body,
                                  headers=AUTH) as r:
                        if r.status_code != 200:
                            self.errors.append(f"{r.status_code} {r.read()[:200]}")
                            return
                        last = None
                        for line in r.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            chunk = json.loads(line[6:])
                            if not chunk["choices"] or not chunk["choices"][0].get("logprobs"):
                                continue
                            now = time.monotonic()
                            if last is not None:
                                self.gaps.append((now - last, now))
                            last = now
                            self.tokens += 1
                            if self.stop.is_set():
                                break
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))
                    return

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def max_gap(self, since: float = 0.0) -> float:
        return max((g for g, t in self.gaps if t >= since), default=0.0)


class Monitor:
    """Diagnostics printed beside the gaps: when the engine made no step for > 0.25 s, when a
    10 ms sleep of a plain thread overslept by > 0.25 s (GIL or OS scheduling), and GC pauses
    over 50 ms; each as (seconds, when: monotonic)."""

    def __init__(self, llm):
        import gc
        self.llm, self.stop = llm, threading.Event()
        self.engine_stalls, self.sleep_lags, self.gc_pauses = [], [], []
        self._gc_start = 0.0
        self._gc = gc
        gc.callbacks.append(self._on_gc)
        threading.Thread(target=self._run, daemon=True, name="hostile-monitor").start()

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.monotonic()
        elif time.monotonic() - self._gc_start > 0.05:
            self.gc_pauses.append((time.monotonic() - self._gc_start, time.monotonic()))

    def _run(self):
        last_id, last_t = self.llm.core.step_id, time.monotonic()
        while not self.stop.is_set():
            t = time.monotonic()
            time.sleep(0.01)
            now = time.monotonic()
            if now - t - 0.01 > 0.25:
                self.sleep_lags.append((now - t - 0.01, now))
            busy = self.llm.core.has_work()
            if self.llm.core.step_id != last_id or not busy:
                if busy and now - last_t > 0.25:
                    self.engine_stalls.append((now - last_t, now))
                last_id, last_t = self.llm.core.step_id, now

    def close(self):
        self.stop.set()
        self._gc.callbacks.remove(self._on_gc)

    def report(self, t0: float) -> str:
        def fmt(xs):
            return [(round(a, 2), round(t - t0, 1)) for a, t in sorted(xs, reverse=True)[:5]]
        load = os.getloadavg()
        return (f"engine stalls {fmt(self.engine_stalls)}, thread oversleeps "
                f"{fmt(self.sleep_lags)}, GC pauses {fmt(self.gc_pauses)}, load average "
                f"{load[0]:.1f} on {os.cpu_count()} cores")


def openai_error(r: httpx.Response, status: int, param: str | None = "_any") -> dict:
    """The response is `status` with an OpenAI error body (naming `param` if given)."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    if param != "_any":
        assert err["param"] == param, err
    return err


def gradio_call(url: str, api: str, data: list, headers=AUTH) -> tuple[str, str]:
    """POST /gradio_api/call/<api>, then read its event stream: (last event, its data)."""
    r = httpx.post(f"{url}/gradio_api/call/{api}", json={"data": data}, headers=headers,
                   timeout=30)
    assert r.status_code == 200, (r.status_code, r.text[:300])
    eid = r.json()["event_id"]
    event, payload = "", ""
    with httpx.stream("GET", f"{url}/gradio_api/call/{api}/{eid}", headers=headers,
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                payload = line[6:]
                if event in ("complete", "error"):
                    break
    return event, payload


def raw_http(port: int, head: bytes, body: bytes = b"") -> str:
    """Send raw bytes (headers that lie about the body) and return the status line + body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < 64:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass
    return data.decode("latin-1")


def chat_body(model: str, content, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


# ---- the cases (each returns nothing; asserts inside) ----------------------------------------
def unauthenticated(s: Server):
    """No key: every route that generates, switches, bursts or reads traces is refused."""
    # every request that reaches the engine passes EngineLoop.add: record them (not inspect(),
    # which holds the engine lock while it copies the engine's state)
    started: list[str] = []
    orig = s.llm.loop.add

    def spy(reqs, *a, **kw):
        started.extend(r.request_id for r in reqs)
        return orig(reqs, *a, **kw)
    s.llm.loop.add = spy
    for method, path, body in [
            ("GET", "/", None), ("GET", "/config", None), ("GET", "/gradio_api/info", None),
            ("POST", "/gradio_api/queue/join", {"data": ["MoE demo (demo-qwen3-moe)", None],
                                                "fn_index": 0, "session_hash": "x"}),
            ("POST", "/gradio_api/call/chat", {"data": ["hi", None, 0, 8, False]}),
            ("POST", "/v1/chat/completions", chat_body(s.model, "hi")),
            ("GET", "/v1/glassbox/traces", None), ("GET", "/v1/models", None)]:
        r = httpx.request(method, s.url + path, json=body, timeout=10)
        openai_error(r, 401)
        r = httpx.request(method, s.url + path, json=body, timeout=10,
                          headers={"Authorization": "Bearer wrong"})
        openai_error(r, 401)
    # a browser is sent to the login page; a wrong key there is refused, the right one opens
    r = httpx.get(s.url + "/", headers={"Accept": "text/html"})
    assert r.status_code == 303 and r.headers["location"].startswith("/login")
    assert httpx.post(s.url + "/login", data={"key": "nope"}).status_code == 401
    r = httpx.post(s.url + "/login", data={"key": KEY, "next": "//evil.example/"})
    assert r.status_code == 303 and r.headers["location"] == "/"    # no open redirect
    cookie = r.cookies.get("glassbox_session")
    assert cookie and KEY not in cookie and "httponly" in r.headers["set-cookie"].lower()
    assert httpx.get(s.url + "/config", cookies={"glassbox_session": cookie}).status_code == 200
    del s.llm.loop.add
    foreign = [r for r in started if not r.startswith("chatcmpl-")]    # not the background's
    assert not foreign, f"requests ran without the key: {foreign}"


def host_header(s: Server):
    """With a key any Host is served (a cluster's DNS name): the key guards the server, and a
    foreign Host is no way around it. The allow-list guards keyless servers (test_edge.py)."""
    for host in ("my-llm-svc:8000", "localhost"):
        assert httpx.get(s.url + "/v1/models", headers={**AUTH, "Host": host}).status_code \
            == 200, host
    r = httpx.post(s.url + "/gradio_api/call/chat", json={"data": ["hi"]},
                   headers={"Host": "attacker.example:7860"})
    openai_error(r, 401)


def body_size(s: Server):
    # a 52 MB body announced without the key: refused from the headers, nothing read
    t0 = time.monotonic()
    out = raw_http(s.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Content-Type: application/json\r\nContent-Length: 52000000\r\n\r\n")
    assert out.startswith("HTTP/1.1 413") or out.startswith("HTTP/1.1 401"), out[:200]
    assert time.monotonic() - t0 < 5
    # with the key: too large, announced or chunked
    big = PAYLOADS["big"]
    openai_error(httpx.post(s.url + "/v1/chat/completions", content=big,
                            headers={**AUTH, "Content-Type": "application/json"}), 413)

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]
    openai_error(httpx.post(s.url + "/v1/chat/completions", content=chunks(),
                            headers={**AUTH, "Content-Type": "application/json"}), 413)


def long_prompts(s: Server):
    """Prompts that cannot fit are refused before tokenizing: fast, and nobody stalls."""
    for content in ("x " * (3 << 19), "🙂" * 1_000_000):
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/chat/completions", json=chat_body(s.model, content),
                       headers=AUTH, timeout=30)
        err = openai_error(r, 400, "messages")
        assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
        assert time.monotonic() - t0 < 5
    r = httpx.post(s.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": s.model, "prompt": list(range(200_000)), "max_tokens": 1})
    assert openai_error(r, 400, "prompt")["code"] == "context_length_exceeded"
    # Gradio's /chat: a 2.5 MB system prompt is refused with the reason
    event, data = gradio_call(s.url, "chat", ["hi", "s" * (5 << 19), 0, 8, False])
    assert event == "error" and "characters" in data, (event, data[:300])


def malformed_bodies(s: Server):
    post = lambda content: httpx.post(s.url + "/v1/chat/completions", content=content,
                                      headers={**AUTH, "Content-Type": "application/json"})
    head = b'{"model": "%s", "messages": [{"role": "user", "content": ' % s.model.encode()
    for case in (head + b'"caf\xff\xfe"}]}',                        # invalid UTF-8
                 head + b'"hi"}], "seed": ' + b"9" * 5000 + b"}",    # 5,000-digit integer
                 b"[" * 100_000 + b"]" * 100_000,                    # deep nesting
                 head + b'"a\\ud800"}]}',                            # lone surrogate
                 b"", b"{not json"):
        err = openai_error(post(case), 400)
        assert "internal" not in err["message"].lower(), err
    bad = [({"temperature": True}, "temperature"), ({"temperature": "1"}, "temperature"),
           ({"max_tokens": 1e300}, "max_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
           ({"stop_token_ids": ["a"]}, "stop_token_ids[0]"), ({"n": 0}, "n"),
           ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
           ({"model": str(DEMO) + "-elsewhere"}, "model")]
    for extra, param in bad:
        body = {**chat_body(s.model, "hi", max_tokens=2), **extra}
        status = 404 if param == "model" else 400
        openai_error(httpx.post(s.url + "/v1/chat/completions", json=body, headers=AUTH),
                     status, param)
    # unknown routes and methods, in OpenAI's shape
    openai_error(httpx.get(s.url + "/v1/nope", headers=AUTH), 404)
    openai_error(httpx.get(s.url + "/v1/chat/completions", headers=AUTH), 405)
    # /v1/models names the model, never a path of the server
    r = httpx.get(s.url + "/v1/models", headers=AUTH)
    assert r.status_code == 200 and str(DEMO) not in r.text and "/" not in \
        r.json()["data"][0]["root"]
    # Gradio's /chat: Infinity max tokens, a non-string system prompt, a lone surrogate
    for data in (["hi", None, 0, float("inf"), False], ["hi", {"a": 1}, 0, 8, False],
                 ["hi\ud800", None, 0, 8, False], [["not", "text"], None, 0, 8, False]):
        payload = json.dumps({"data": data})      # Infinity and \ud800 as Python writes them
        r = httpx.post(s.url + "/gradio_api/call/chat", content=payload,
                       headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        eid = r.json()["event_id"]
        text = httpx.get(f"{s.url}/gradio_api/call/chat/{eid}", headers=AUTH, timeout=30).text
        assert "event: error" in text and "Traceback" not in text, text[:300]


PAYLOADS: dict[str, bytes] = {}


def build_payloads(model: str) -> None:
    """Large bodies, encoded before the background streams start: encoding them (json.dumps
    of 10^6 ints holds the GIL for seconds under load) is the client's cost, and the client
    shares this process with the server."""
    PAYLOADS["big"] = json.dumps(chat_body(model, "x" * (5 << 20))).encode()
    PAYLOADS["ids"] = json.dumps(chat_body(model, "hi", stop_token_ids=list(range(10 ** 6)))
                                 ).encode()
    PAYLOADS["stops"] = json.dumps(chat_body(model, "hi", stop=[f"s{i}" for i in range(10_000)])
                                   ).encode()


def stop_lists(s: Server):
    url = s.url + "/v1/chat/completions"
    jh = {**AUTH, "Content-Type": "application/json"}
    openai_error(httpx.post(url, headers=jh, content=PAYLOADS["stops"]), 400, "stop")
    openai_error(httpx.post(url, headers=AUTH, json=chat_body(
        s.model, "hi", stop=["x" * 5000])), 400, "stop")
    openai_error(httpx.post(url, headers=AUTH, json=chat_body(
        s.model, "hi", stop_token_ids=list(range(2000)))), 400, "stop_token_ids")
    openai_error(httpx.post(url, headers=jh, content=PAYLOADS["ids"]), 413)
    # at the caps: served, and correct (the same text as without the never-matching stops)
    plain = chat_body(s.model, "What is 47+38?", temperature=0, max_tokens=12)
    want = httpx.post(url, headers=AUTH, json=plain, timeout=60).json()
    stops = [f"never-{i}-" + "q" * 240 for i in range(64)]
    got = httpx.post(url, headers=AUTH, timeout=60, json={
        **plain, "stop": stops, "stop_token_ids": list(range(3000, 4024)), "min_tokens": 12,
        "ignore_eos": True}).json()
    assert got["choices"][0]["message"]["content"].startswith(
        want["choices"][0]["message"]["content"]) or got["usage"]["completion_tokens"] == 12


def traces(s: Server):
    from engine import ProbeSpec, SamplingParams
    # a page's reply (traced in the engine) is not the API's to list or read
    s.hub.llm.generate([[{"role": "user", "content": "hi"}]],
                       SamplingParams(temperature=0, max_tokens=2), watch=ProbeSpec())
    other = s.hub.llm.traced_requests()[0]
    r = httpx.post(s.url + "/v1/chat/completions", headers=AUTH, json=chat_body(
        s.model, "hi", max_tokens=2, glassbox={"watch": True}))
    mine = r.json()["glassbox"]["request_id"] if "request_id" in r.json().get("glassbox", {}) \
        else r.json()["id"]
    listed = [t["id"] for t in httpx.get(s.url + "/v1/glassbox/traces", headers=AUTH)
              .json()["data"]]
    assert mine in listed and other not in listed
    openai_error(httpx.get(f"{s.url}/v1/glassbox/traces/{other}", headers=AUTH), 404)
    assert httpx.get(f"{s.url}/v1/glassbox/traces/{mine}", headers=AUTH).status_code == 200


def burst(s: Server):
    """The burst through Gradio's queue: refused when turned off; bounded; one at a time."""
    from views.kv_cache import MAX_BURST, fire_burst
    idx = next(i for i, fn in s.demo.fns.items() if getattr(fn.fn, "__name__", "") == "on_burst")

    def fire(n, tokens) -> str:
        sh = f"hostile-{time.monotonic_ns()}"
        r = httpx.post(s.url + "/gradio_api/queue/join", headers=AUTH, json={
            "data": [n, tokens], "fn_index": idx, "session_hash": sh, "trigger_id": None,
            "event_data": None})
        assert r.status_code == 200, r.text
        with httpx.stream("GET", f"{s.url}/gradio_api/queue/data?session_hash={sh}",
                          headers=AUTH, timeout=60) as st:
            for line in st.iter_lines():
                if '"process_completed"' in line:
                    return json.dumps(json.loads(line[6:])["output"])
        return ""
    threads0 = threading.active_count()
    s.hub.burst_enabled = False
    assert "turned off" in fire(6, 64)
    s.hub.burst_enabled = True
    assert "fired 6 requests" in fire(6, 64)
    assert "still running" in fire(6, 64)
    with pytest.raises(ValueError, match="1 to 16 requests"):
        fire_burst(s.hub, MAX_BURST + 1, 8)
    assert threading.active_count() <= threads0 + 2      # no thread per burst request
    wait_until(lambda: not s.hub.__dict__.get("burst_live"), timeout=90)


CASES = [unauthenticated, host_header, body_size, long_prompts, malformed_bodies, stop_lists,
         traces, burst]


def test_hostile_clients_get_clear_errors_and_nobody_stalls(server):
    from api.limits import trim_heap
    s = server
    # warm: every pool and path has run once, so the baseline counts their threads and memory
    for _ in range(2):
        httpx.post(s.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json=chat_body(s.model, "warm up " * 200, max_tokens=4))
        gradio_call(s.url, "chat", ["warm up", None, 0, 4, False])
    build_payloads(s.model)
    bg = Background(s.url, s.model)
    bg.start()
    time.sleep(1.0)
    trim_heap(force=True)
    rss0, threads0 = rss_mb(), threading.active_count()
    mon = Monitor(s.llm)
    t_attack = time.monotonic()
    for case in CASES:
        t0 = time.monotonic()
        case(s)
        print(f"{case.__name__}: {time.monotonic() - t0:.1f} s, longest gap so far "
              f"{bg.max_gap(t_attack):.2f} s")
    time.sleep(0.5)
    bg.finish()
    mon.close()
    assert not bg.errors, bg.errors
    worst = [(round(g, 2), round(t - t_attack, 1)) for g, t in
             sorted(((g, t) for g, t in bg.gaps if t >= t_attack), reverse=True)[:5]]
    print("longest gaps (s, at s after the attacks began):", worst)
    print(mon.report(t_attack))
    assert bg.max_gap(t_attack) <= MAX_GAP_S, \
        f"a background stream stalled: {worst}; {mon.report(t_attack)}"
    assert bg.tokens > 200

    # afterwards: every KV block free, threads and RSS back near the warm baseline
    def idle():
        snap = s.llm.inspect()
        return not snap.running and not snap.waiting and not any(b.owners for b in snap.blocks)
    wait_until(idle, timeout=60)
    wait_until(lambda: threading.active_count() <= threads0 + 2, timeout=30)
    time.sleep(3.5)         # the server's own heap trims after large requests (api.guard)
    rss1 = rss_mb()
    # Gradio keeps a bounded number of sessions (each /call/chat makes one)
    import app
    assert s.demo.server_app.state_holder.capacity == app.MAX_SESSIONS
    print(f"RSS warm {rss0:.0f} MB, after the attacks {rss1:.0f} MB; threads {threads0} -> "
          f"{threading.active_count()}")
    assert rss1 <= rss0 * 1.2, f"RSS {rss0:.0f} MB -> {rss1:.0f} MB after the hostile burst"


# ---- start-up refusals (no server) -------------------------------------------------------------
def test_binding_beyond_localhost_without_a_key_needs_the_explicit_flag():
    from api.auth import exposure_refusal
    assert exposure_refusal("127.0.0.1", None, False, False) is None
    msg = exposure_refusal("0.0.0.0", None, False, False)
    assert "--allow-unauthenticated" in msg and "model switch" in msg and "/v1" in msg
    assert exposure_refusal("0.0.0.0", None, True, False) and \
        exposure_refusal("127.0.0.1", None, True, False)         # a share link is public
    assert exposure_refusal("0.0.0.0", "k", False, False) is None
    assert exposure_refusal("0.0.0.0", None, False, True) is None


def test_host_allow_list():
    from api.guard import host_allowed
    for ok in ("localhost", "localhost:7860", "127.0.0.1:7860", "[::1]:7860", "10.1.2.3",
               "app.localhost"):
        assert host_allowed(ok, ()), ok
    for bad in ("attacker.example", "attacker.example:7860", "localhost.attacker.example",
                "127.0.0.1.nip.io", ""):
        assert not host_allowed(bad, ()), bad
    assert host_allowed("glassbox.lab.example", ("*.lab.example",))
    assert host_allowed("anything.example", ("*",))


def test_malformed_generation_config_names_the_file(qwen3_dir, tmp_path):
    import shutil

    from engine import LLM
    from engine.errors import CheckpointFormatError
    d = tmp_path / "ckpt"
    shutil.copytree(qwen3_dir, d)
    (d / "generation_config.json").write_text('{"eos_token_id": [1, ')
    with pytest.raises(CheckpointFormatError, match="generation_config.json"):
        LLM(str(d), device="cpu", num_kv_blocks=16)
    (d / "generation_config.json").write_text('{"eos_token_id": ["x"]}')
    with pytest.raises(CheckpointFormatError, match="eos_token_id must be an integer"):
        LLM(str(d), device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("field,value,match", [
    ("num_hidden_layers", 10 ** 6, "num_hidden_layers=1,000,000 is beyond any real model"),
    ("hidden_size", -4, "hidden_size must be a non-negative integer"),
    ("vocab_size", 2 ** 22, "memory available"),        # within the ceilings, too big here
])
def test_absurd_config_is_refused_before_allocating(qwen3_dir, tmp_path, field, value, match):
    import shutil

    from engine import LLM
    d = tmp_path / "huge"
    shutil.copytree(qwen3_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    if field == "vocab_size":
        cfg["hidden_size"] = cfg["intermediate_size"] = 8192
        cfg["head_dim"] = 8192 // cfg["num_attention_heads"]
    (d / "config.json").write_text(json.dumps(cfg))
    rss0 = rss_mb()
    with pytest.raises(ValueError, match=match) as e:
        LLM(str(d), device="cpu", num_kv_blocks=16)
    assert "config.json" in str(e.value) or "memory" in str(e.value)
    assert rss_mb() - rss0 < 200, "it allocated before refusing"


# ---- a browser with the key: the login page, then the playground as usual --------------------
@pytest.mark.slow
def test_a_browser_types_the_key_once_and_the_playground_works(server):
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed")
    from test_browser import bot_text, headless_chromium, new_page, send
    gen = headless_chromium()
    browser = next(gen)
    try:
        page = new_page(browser)
        page.goto(server.url + "/")
        assert "/login" in page.url                 # no key yet: the login page, not the app
        page.fill("#key", "wrong")
        page.click("#login")
        page.wait_for_selector("#login-error")
        page.fill("#key", KEY)
        page.click("#login")
        page.wait_for_selector("#chat-input textarea")
        send(page, "What is 47+38?", max_tokens=8)
        wait_until(lambda: bot_text(page).strip(), timeout=60)
        # the session cookie is HttpOnly: the page's scripts cannot read the key's token
        assert "glassbox_session" not in page.evaluate("document.cookie")
    finally:
        next(gen, None)

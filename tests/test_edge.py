"""The server's edge over HTTP, as a client, a cluster and a browser see it: model ids (served
names, a path's id), the Host allow-list (a keyless local server only), CORS with vLLM's
flags (the API's routes; Gradio's keep their own rules), and cross-site requests refused by a
keyless server (a foreign Origin is a 403, a JSON body sent as text or a form a 415)."""
from __future__ import annotations

import os

import httpx
import pytest

from ui_helpers import free_port, require_engine  # noqa: I001

KEY = "edge-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EVIL = "https://evil.example"


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    require_engine()
    from engine import LLM
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    yield llm
    llm.shutdown()


class Playground:
    """The playground (Gradio + API) over a shared engine, launched with `launch_kw`."""

    def __init__(self, llm, served_model_names=(), **launch_kw):
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
        import app
        self.llm = llm
        self.demo = app.build_app(llm, served_model_names=served_model_names)
        self.port = free_port()
        app.launch(self.demo, port=self.port, prevent_thread_lock=True, **launch_kw)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.demo.close()       # the engine is the module's


class BareAPI:
    """The API alone (api.server), as benchmarks and scripts serve it."""

    def __init__(self, llm, **kw):
        from api.server import BackgroundServer, create_app
        self.server = BackgroundServer(create_app(llm, **kw))
        self.url = self.server.url

    def close(self):
        self.server.stop()


@pytest.fixture(scope="module")
def keyless(llm):
    p = Playground(llm)
    yield p
    p.close()


@pytest.fixture(scope="module")
def keyed(llm):
    p = Playground(llm, served_model_names=("tiny-served", "alias"), api_key=KEY)
    yield p
    p.close()


@pytest.fixture
def bare(llm):
    """bare(**create_app kwargs) -> a running BareAPI, stopped after the test."""
    made = []

    def make(**kw):
        made.append(BareAPI(llm, **kw))
        return made[-1]
    yield make
    for b in made:
        b.close()


def completion(url: str, model: str | None = None, headers: dict | None = None, **kw):
    body = {"prompt": [1, 2, 3], "max_tokens": 1, **({"model": model} if model else {})}
    return httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=30, **kw)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    return err


# ---- model ids (#49) --------------------------------------------------------------------------
def test_served_model_names_list_the_first_and_answer_to_every_one(keyed):
    r = httpx.get(keyed.url + "/v1/models", headers=AUTH)
    assert [m["id"] for m in r.json()["data"]] == ["tiny-served"]
    for name in ("tiny-served", "alias"):
        assert completion(keyed.url, name, AUTH).status_code == 200, name
        assert httpx.get(f"{keyed.url}/v1/models/{name}", headers=AUTH).json()["id"] == \
            "tiny-served"
    assert openai_error(completion(keyed.url, "gpt-4", AUTH), 404)["code"] == "model_not_found"


def test_a_model_started_from_a_path_answers_to_the_path_as_given_and_its_basename(keyless, llm):
    given = llm.config.model                        # the argument the engine was started with
    r = httpx.get(keyless.url + "/v1/models")
    assert [m["id"] for m in r.json()["data"]] == [llm.model_name]   # listed: never a path
    assert given not in r.text
    for name in (given, llm.model_name):
        assert completion(keyless.url, name).status_code == 200, name
    openai_error(completion(keyless.url, given + "-other"), 404)


def test_the_bare_api_takes_served_model_names_too(bare):
    api = bare(served_model_names=("served",))
    assert [m["id"] for m in httpx.get(api.url + "/v1/models").json()["data"]] == ["served"]
    assert completion(api.url, "served").status_code == 200


# ---- the Host header (#49) ----------------------------------------------------------------------
def test_with_a_key_a_cluster_dns_name_is_served(keyed):
    for path in ("/v1/models", "/config"):
        r = httpx.get(keyed.url + path, headers={**AUTH, "Host": "my-llm-svc:8000"})
        assert r.status_code == 200, (path, r.text[:200])
    r = completion(keyed.url, "alias", {**AUTH, "Host": "my-llm-svc.default.svc.cluster.local"})
    assert r.status_code == 200, r.text


def test_a_keyless_server_still_refuses_dns_names_it_was_not_given(keyless, bare):
    err = openai_error(httpx.get(keyless.url + "/v1/models", headers={"Host": "my-llm-svc:8000"}),
                       400)
    assert err["code"] == "invalid_host" and "--allowed-hosts" in err["message"]
    api = bare(allowed_hosts=("*",))
    assert httpx.get(api.url + "/v1/models", headers={"Host": "my-llm-svc:8000"}).status_code \
        == 200


# ---- CORS (#49) ---------------------------------------------------------------------------------
def preflight(url: str, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(url + path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_with_a_key_the_api_answers_any_origin_as_vllm_does(keyed):
    r = preflight(keyed.url, "https://app.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.headers
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(keyed.url + "/v1/models", headers={**AUTH, "Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in r.headers


def test_gradio_routes_keep_their_own_cors_rules(keyed):
    r = httpx.get(keyed.url + "/config", headers={**AUTH, "Origin": "https://app.example"})
    assert r.status_code == 200
    assert r.headers.get("access-control-allow-origin") != "*"
    assert r.headers.get("access-control-allow-origin") != "https://app.example"


def test_without_a_key_only_this_machines_origins_pass_cors(keyless):
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8080"):
        r = preflight(keyless.url, origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, \
            (origin, r.status_code, r.headers)
    r = preflight(keyless.url, EVIL)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers


def test_cors_flags_name_the_origins_methods_headers_and_credentials(bare):
    api = bare(api_key=KEY, cors=_cors(allowed_origins=("https://app.example",),
                                       allowed_methods=("GET", "POST"),
                                       allowed_headers=("Authorization", "Content-Type"),
                                       allow_credentials=True))
    r = preflight(api.url, "https://app.example")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert set(r.headers["access-control-allow-methods"].replace(" ", "").split(",")) >= \
        {"GET", "POST"} and "DELETE" not in r.headers["access-control-allow-methods"]
    assert preflight(api.url, "https://other.example").status_code == 400


def _cors(**kw):
    from api.cors import CORSSettings
    return CORSSettings(**kw)


# ---- cross-site requests on a keyless server (#48) ----------------------------------------------
def test_a_keyless_server_refuses_a_cross_site_simple_post(keyless):
    r = httpx.post(keyless.url + "/v1/completions", content=b'{"prompt": [1, 2], "max_tokens": 1}',
                   headers={"Content-Type": "text/plain", "Origin": EVIL})
    err = openai_error(r, 403)
    assert EVIL in err["message"] and "--allowed-origins" in err["message"]
    openai_error(completion(keyless.url, headers={"Origin": EVIL}), 403)
    openai_error(completion(keyless.url, headers={"Origin": "null"}), 403)


@pytest.mark.parametrize("path,body", [
    ("/gradio_api/call/chat", {"data": ["hi", None, 0, 2, False]}),
    ("/gradio_api/queue/join", {"data": [], "fn_index": 0, "session_hash": "x"}),
])
def test_a_keyless_server_refuses_cross_site_posts_to_gradio_too(keyless, path, body):
    r = httpx.post(keyless.url + path, json=body, headers={"Origin": EVIL})
    assert EVIL in openai_error(r, 403)["message"]


def test_this_machines_pages_and_the_playground_itself_are_not_cross_site(keyless):
    for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "http://[::1]:5173",
                   keyless.url):
        assert completion(keyless.url, headers={"Origin": origin}).status_code == 200, origin
    r = httpx.post(keyless.url + "/gradio_api/call/chat", json={"data": ["hi", None, 0, 2, False]},
                   headers={"Origin": keyless.url})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_a_json_api_body_sent_as_text_or_a_form_is_refused(keyless, ctype):
    r = httpx.post(keyless.url + "/v1/completions", content=b'{"prompt": [1], "max_tokens": 1}',
                   headers={"Content-Type": ctype})
    assert "application/json" in openai_error(r, 415)["message"]


def test_a_json_body_without_a_content_type_is_still_json(keyless):
    r = httpx.post(keyless.url + "/v1/completions", content=b'{"prompt": [1], "max_tokens": 1}')
    assert r.status_code == 200, r.text


def test_with_a_key_the_origin_is_not_what_guards_it(keyed):
    assert completion(keyed.url, "alias", {**AUTH, "Origin": EVIL}).status_code == 200
    openai_error(completion(keyed.url, "alias", {"Origin": EVIL}), 401)


def test_allowed_origins_let_a_named_site_post_to_a_keyless_server(bare):
    api = bare(cors=_cors(allowed_origins=(EVIL,)))
    r = completion(api.url, headers={"Origin": EVIL})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == EVIL
    openai_error(completion(api.url, headers={"Origin": "https://other.example"}), 403)

"""One ASGI middleware in front of every route of the server, Gradio's and the API's alike.

In order, each check before the request costs anything:
1. Host header allow-list, on a keyless server only (DNS rebinding: a page on attacker.example
   whose name resolves to 127.0.0.1 must not reach a server that has no key): IP literals,
   `localhost` and `*.localhost`, and the names given with --allowed-hosts (`*`: any). With a
   key every Host is served (a cluster's DNS name, `my-llm-svc:8000`): the key guards it.
2. Body size: a Content-Length above the cap is refused at once (413); a body without one
   (chunked) is read up to the cap and refused beyond it. Nothing is parsed here.
3. Cross-site requests, on a keyless server: a POST, PUT, PATCH or DELETE (or a websocket)
   whose Origin is a page neither on this machine, nor this server's own, nor named with
   --allowed-origins is a 403 (api.cors.origin_allowed): a page the user visits cannot drive
   their local server. And on the API's routes a body sent as text or a form (the types a page
   may send without asking first) is a 415: the API reads JSON.
4. The key, when the server has one, on every route: `Authorization: Bearer KEY` (API clients,
   gradio_client's `headers=`), or the session cookie a browser gets from the /login page by
   typing the key once. A browser opening a page without it is sent to /login; anything else
   gets a 401 in OpenAI's error shape. Only /login, /health, /ping and /version are open; /metrics
   is not (vLLM's is): its prefix-cache counters tell whether another user's prompt was cached.
After a large request (a body over `Limits.heavy_request_bytes`) the heap is trimmed, so the
memory its parsing and tokenizing used goes back to the OS.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import ipaddress
import secrets
from urllib.parse import parse_qs, quote

from .auth import API_KEY_ENV
from .cors import CORSSettings, every_path, origin_allowed
from .errors import APIError
from .limits import Limits, Pools, default_pools, trim_heap

COOKIE = "glassbox_session"
# open without the key: the login page, health, and the call Gradio makes to itself at launch
# (it runs the startup events once; idempotent)
# (/metrics is not: its prefix-cache counters tell whether another user's prompt was cached)
OPEN_PATHS = ("/login", "/health", "/ping", "/version", "/gradio_api/startup-events")
AUTH_SCOPE_KEY = "glassbox.auth"     # set in the ASGI scope: how the request authenticated
LOGIN_MAX_BYTES = 4096
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")
JSON_TYPES = ("application/json",)      # and any application/*+json
TRIM_AFTER_S = (0.5, 3.0)           # heap trims after a large request (api.limits.trim_heap)


def host_name(header: str) -> str:
    """'Example.COM:7860' -> 'example.com'; '[::1]:7860' -> '::1'."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_allowed(header: str | None, allowed: tuple[str, ...]) -> bool:
    if header is None:          # HTTP/1.0 without Host: not a browser, nothing to rebind
        return True
    name = host_name(header).rstrip(".")
    if not name:
        return False
    if is_ip(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    for a in allowed:
        a = a.lower().rstrip(".")
        if a == "*" or a == name or (a.startswith("*.") and name.endswith(a[1:])):
            return True
    return False


LOGIN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>Glassbox: key</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:system-ui,sans-serif;max-width:28em;margin:4em auto;padding:0 1em}}
input{{font-size:1em;padding:.4em;width:100%;box-sizing:border-box;margin:.4em 0}}
button{{font-size:1em;padding:.4em 1.2em}} .err{{color:#b00}}</style></head><body>
<h2>Glassbox</h2><p>This server needs its key (the one it was started with: <code>--api-key</code>
or <code>{env}</code>).</p>{error}
<form method="post" action="/login"><input type="hidden" name="next" value="{next}">
<input id="key" type="password" name="key" autofocus autocomplete="current-password"
 placeholder="key"><button id="login" type="submit">Open the playground</button></form>
</body></html>"""


class Guard:
    """ASGI middleware (see the module docstring). `api_key` None: no key is needed."""

    def __init__(self, app, api_key: str | None = None, allowed_hosts: tuple[str, ...] = (),
                 limits: Limits | None = None, pools: Pools | None = None, *,
                 cors: CORSSettings | None = None, is_api_path=every_path):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.allowed = tuple(allowed_hosts)
        self.cors = cors or CORSSettings()
        self.is_api_path = is_api_path
        self.limits = limits or Limits()
        self.pools = pools or default_pools()
        secret = secrets.token_bytes(32)      # cookies die with the process
        self.session = (hmac.new(secret, self.key, hashlib.sha256).hexdigest()
                        if self.key else None)

    # ---- the ASGI entry --------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        refusal = self._refuse_host(headers)
        if refusal is None and kind == "http":
            refusal = self._refuse_size(headers)
        if refusal is None:
            refusal = self._refuse_cross_site(scope, headers)
        if refusal is None and kind == "http":
            refusal = self._refuse_media_type(scope, headers)
        how = None
        if refusal is None:
            how = self._authenticate(headers)
            if how is None and scope["path"] not in OPEN_PATHS:
                refusal = self._unauthenticated(scope, headers)
        if refusal is not None:
            if kind == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await refusal(scope, receive, send)
        scope[AUTH_SCOPE_KEY] = how
        if kind == "http" and scope["path"] == "/login":
            return await self._login(scope, receive, send)
        if kind == "http" and "content-length" not in headers and \
                scope.get("method") in ("POST", "PUT", "PATCH"):
            receive = await self._bounded_body(receive)
            if isinstance(receive, _Respond):
                return await receive(scope, self._empty_receive, send)
        heavy = int(headers.get("content-length") or 0) >= self.limits.heavy_request_bytes
        try:
            await self.app(scope, receive, send)
        finally:
            if heavy:       # a large body was parsed (and maybe tokenized): give it back,
                # soon and once more later (Gradio's queue runs the work after answering)
                loop = asyncio.get_running_loop()
                for delay in TRIM_AFTER_S:
                    loop.call_later(delay, self.pools.control.submit, trim_heap)

    # ---- checks ----------------------------------------------------------------------------
    def _refuse_host(self, headers):
        if self.key is not None or host_allowed(headers.get("host"), self.allowed):
            return None
        name = host_name(headers.get("host", ""))
        return APIError(400, f"the Host header {name!r} is not allowed: this server has no key, "
                             "so it answers to localhost and IP addresses only (DNS rebinding); "
                             f"start it with --allowed-hosts {name} to serve that name, or give "
                             "it a key (--api-key)", code="invalid_host").response()

    def _refuse_cross_site(self, scope, headers):
        """A keyless server takes no state-changing request from another site's page."""
        if self.key is not None or (scope["type"] == "http"
                                    and scope.get("method") not in STATE_CHANGING):
            return None
        origin = headers.get("origin")
        if origin is None or origin_allowed(origin, self.cors, headers.get("host")):
            return None
        return APIError(403, f"cross-site request refused: a page on {origin!r} sent it, and "
                             "this server has no key, so it takes requests only from pages on "
                             "this machine (localhost, 127.0.0.1, [::1]) and its own. To let "
                             f"that site use it, start the server with --allowed-origins "
                             f"{origin} (or give it a key with --api-key)",
                        code="cross_site_request").response()

    def _refuse_media_type(self, scope, headers):
        """The API reads JSON: a body sent as text or a form (what a page may send to another
        site without asking first) is refused, as FastAPI refuses it to vLLM."""
        ctype = headers.get("content-type")
        if ctype is None or scope.get("method") not in ("POST", "PUT", "PATCH") or \
                headers.get("content-length", "").strip() == "0" or \
                not self.is_api_path(scope["path"]):
            return None
        media = ctype.split(";", 1)[0].strip().lower()
        if media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json")):
            return None
        return APIError(415, f"the request body is sent as {media or 'nothing'!r}; the API "
                             "reads JSON: send it with 'Content-Type: application/json'",
                        code="unsupported_media_type").response()

    def _refuse_size(self, headers):
        cl = headers.get("content-length")
        if cl is None:
            return None
        if not cl.strip().isdigit():
            return APIError(400, "the Content-Length header is not a number",
                            code="invalid_request").response()
        if int(cl) > self.limits.max_request_bytes:
            return self._too_large(int(cl))
        return None

    def _too_large(self, size: int | None):
        got = f"{size:,} bytes" if size is not None else "more"
        return APIError(413, f"the request body is {got}; the limit is "
                             f"{self.limits.max_request_bytes:,} bytes (--max-request-bytes)",
                        code="request_too_large").response()

    def _authenticate(self, headers) -> str | None:
        """'open' without a key; 'bearer' or 'cookie' with the right key; else None."""
        if self.key is None:
            return "open"
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token and \
                hmac.compare_digest(token.strip().encode(), self.key):
            return "bearer"
        cookie = _cookie(headers.get("cookie", ""), COOKIE)
        if cookie and hmac.compare_digest(cookie.encode(), self.session.encode()):
            return "cookie"
        return None

    def _unauthenticated(self, scope, headers):
        from starlette.responses import RedirectResponse
        if scope["type"] == "http" and scope.get("method") == "GET" and \
                "text/html" in headers.get("accept", "") and not scope["path"].startswith("/v1"):
            nxt = scope["path"] + (("?" + scope["query_string"].decode("latin-1"))
                                   if scope.get("query_string") else "")
            return RedirectResponse("/login?next=" + quote(nxt, safe=""), status_code=303)
        sent = headers.get("authorization", "")
        msg = ("incorrect API key provided" if sent else
               "missing API key: send the header 'Authorization: Bearer KEY' (the key the "
               f"server was started with, --api-key or {API_KEY_ENV}); a browser opens /login")
        return APIError(401, msg, code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"}).response()

    async def _bounded_body(self, receive):
        """Read a body without Content-Length up to the cap: a replaying receive, or the 413
        response (not callable as a receive: the caller sends it)."""
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            size += len(msg.get("body", b""))
            if size > self.limits.max_request_bytes:
                return _Respond(self._too_large(None))
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return replay

    @staticmethod
    async def _empty_receive():
        return {"type": "http.disconnect"}

    # ---- the login page --------------------------------------------------------------------
    async def _login(self, scope, receive, send):
        from starlette.responses import HTMLResponse, RedirectResponse
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        nxt = _local_path((query.get("next") or ["/"])[0])
        if self.key is None:
            return await RedirectResponse(nxt, status_code=303)(scope, receive, send)
        if scope.get("method") != "POST":
            page = LOGIN_PAGE.format(env=API_KEY_ENV, error="", next=html.escape(nxt))
            return await HTMLResponse(page)(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False) and msg["type"] == "http.request"
            if len(body) > LOGIN_MAX_BYTES:
                return await self._too_large(len(body))(scope, receive, send)
        form = parse_qs(body.decode("utf-8", "replace"))
        key = (form.get("key") or [""])[0]
        nxt = _local_path((form.get("next") or [nxt])[0])
        if not hmac.compare_digest(key.strip().encode(), self.key):
            page = LOGIN_PAGE.format(env=API_KEY_ENV, next=html.escape(nxt),
                                     error='<p class="err" id="login-error">Wrong key.</p>')
            return await HTMLResponse(page, status_code=401)(scope, receive, send)
        r = RedirectResponse(nxt, status_code=303)
        r.set_cookie(COOKIE, self.session, httponly=True, samesite="strict", path="/")
        return await r(scope, receive, send)


class _Respond:
    """A response the guard sends instead of calling the app."""

    def __init__(self, response):
        self.response = response

    async def __call__(self, scope, receive, send):
        return await self.response(scope, receive, send)


def _local_path(p: str) -> str:
    """Only a path on this server (no `//host` or `scheme:`): the login redirect is no open
    redirect."""
    return p if p.startswith("/") and not p.startswith("//") and "\\" not in p else "/"


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None

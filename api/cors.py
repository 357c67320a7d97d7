"""Which web pages may use the server: CORS on the API's routes with vLLM's flags, and the Origins
a keyless server takes state-changing requests from (api.guard refuses the others).

vLLM's flags and meaning: `--allowed-origins`, `--allowed-methods`, `--allowed-headers` (lists,
`*` for any), `--allow-credentials`. With a key their defaults are vLLM's (`*`, no credentials):
the key is what guards the server, CORS only lets pages read the answers. Without a key the
default is this machine's pages alone (http(s)://localhost, 127.0.0.1 or [::1], any port) plus
the origins the flag names: a keyless server is one the user runs for themself, and any page
they visit could otherwise drive it.

Only the API's paths get these headers; Gradio's own routes keep Gradio's stricter CORS rules.
Gradio's CORS middleware sits inside the app and would add its own headers to an API answer, so
`APICors` wraps the whole app (uvicorn's outermost layer) and drops theirs on API paths.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

# a page served from this machine, any port
SAME_MACHINE = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"
_SAME_MACHINE = re.compile(SAME_MACHINE, re.I)


@dataclass(frozen=True)
class CORSSettings:
    allowed_origins: tuple[str, ...] | None = None  # None: `*` with a key, this machine without
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def same_machine(origin: str) -> bool:
    return bool(_SAME_MACHINE.fullmatch(origin.strip()))


def same_origin(origin: str, host: str | None) -> bool:
    """The page asking is one this server served (its Origin's host[:port] is the Host header):
    the playground itself, however it was reached."""
    if not host:
        return False
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default = {"http": ":80", "https": ":443"}[parts.scheme]
    netloc = parts.netloc.lower().removesuffix(default)
    return netloc == host.strip().lower().removesuffix(default)


def origin_allowed(origin: str, settings: CORSSettings, host: str | None) -> bool:
    """May a page from `origin` send a keyless server a request that changes something?"""
    listed = settings.allowed_origins or ()
    return ("*" in listed or origin.strip() in listed or same_machine(origin)
            or same_origin(origin, host))


def api_path_matcher(paths) -> Callable[[str], bool]:
    """A predicate for the API's paths, from its routes' path templates: an exact path, the
    prefix of a templated one (`/v1/models/{model:path}`), and anything under /v1/."""
    exact = {p for p in paths if "{" not in p}
    prefixes = tuple({p.split("{", 1)[0] for p in paths if "{" in p} | {"/v1/"})
    return lambda path: path in exact or path.startswith(prefixes)


def every_path(path: str) -> bool:
    return True


class APICors:
    """ASGI: starlette's CORSMiddleware with vLLM's settings on the API's paths; every other
    path passes untouched (to Gradio's own CORS)."""

    def __init__(self, app, settings: CORSSettings | None = None, keyed: bool = False,
                 is_api_path: Callable[[str], bool] = every_path):
        from starlette.middleware.cors import CORSMiddleware
        settings = settings or CORSSettings()
        self.app, self.is_api_path = app, is_api_path
        origins = settings.allowed_origins
        if origins is None:
            origins = ("*",) if keyed else ()
        self.cors = CORSMiddleware(
            self._without_inner_cors, allow_origins=list(origins),
            allow_origin_regex=None if keyed or "*" in origins else SAME_MACHINE,
            allow_methods=list(settings.allowed_methods),
            allow_headers=list(settings.allowed_headers),
            allow_credentials=settings.allow_credentials)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.is_api_path(scope["path"]):
            return await self.cors(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _without_inner_cors(self, scope, receive, send):
        """The app, with any CORS header a middleware inside it added taken off."""
        async def strip(message):
            if message["type"] == "http.response.start":
                message["headers"] = [(k, v) for k, v in message.get("headers", ())
                                      if not k.lower().startswith(b"access-control-")]
            await send(message)
        return await self.app(scope, receive, strip)

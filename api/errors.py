"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right
status, never a traceback. `OpenAIRoute` turns every exception of a route into one, so the
routes behave the same on the playground's Gradio server and on a bare FastAPI app."""
from __future__ import annotations

import json
import logging
import re

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.responses import Response

log = logging.getLogger("glassbox.api")

_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "invalid_request_error",
                   404: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request the API refuses: HTTP status, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPE_OF_STATUS.get(self.status,
                                                                              "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# ---- pydantic validation errors -> 400 naming the parameter ---------------------------------
_TYPE_TAG = re.compile(r"[\[\(-]|^(str|int|float|bool|list|dict|none|literal)$", re.I)


def param_of(loc) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'. Union member tags
    that pydantic adds to locations (`str`, `list[int]`, `function-after[...]`) are dropped."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and not _TYPE_TAG.search(p):
            out += f".{p}" if out else p
    return out or None


def from_validation(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("the request body is not valid")
    e = errors[0]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return bad_request("the request body is not valid JSON: "
                           f"{e.get('ctx', {}).get('error', e.get('msg'))}")
    param = param_of(e.get("loc", ()))
    if kind == "missing" and param is None:
        return bad_request("the request needs a JSON body")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return bad_request(f"'{param}' is a required property", param)
    got = e.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {msg} (got {shown})", param)


class OpenAIRoute(APIRoute):
    """An APIRoute whose every failure is an OpenAI error body; unexpected ones are logged."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request):
            try:
                return await handler(request)
            except APIError as e:
                return e.response()
            except RequestValidationError as e:
                return from_validation(e).response()
            except Exception as e:     # a bug or an engine failure: say what, keep the server up
                log.exception("unhandled error in %s", request.url.path)
                return APIError(500, f"internal error: {type(e).__name__}: {e}").response()
        return route_handler


# ---- unknown routes and methods: OpenAI's shape under /v1 --------------------------------------
_HTTP_MESSAGES = {404: "Not found: {method} {path} is not a route of this server (GET /v1/models, "
                       "POST /v1/chat/completions, POST /v1/completions)",
                  405: "Method not allowed: {method} {path}"}


async def http_exception_handler(request, exc):
    """A FastAPI exception handler for HTTPException: under /v1 an OpenAI error body (404,
    405, ...), elsewhere FastAPI's own answer (Gradio's routes keep theirs)."""
    from fastapi.exception_handlers import http_exception_handler as default
    if not request.url.path.startswith("/v1"):
        return await default(request, exc)
    template = _HTTP_MESSAGES.get(exc.status_code)
    msg = (template.format(method=request.method, path=request.url.path) if template
           else str(exc.detail))
    headers = dict(getattr(exc, "headers", None) or {})
    return APIError(exc.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}
                    .get(exc.status_code), headers=headers).response()


def exception_handlers() -> dict:
    """For FastAPI(exception_handlers=...): the playground passes it through Gradio's
    app_kwargs, api.server.create_app to its own app."""
    from starlette.exceptions import HTTPException
    return {HTTPException: http_exception_handler}

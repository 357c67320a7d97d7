"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right
status, never a traceback. `OpenAIRoute` turns every exception of a route into one, so the
routes behave the same on the playground's Gradio server and on a bare FastAPI app."""
from __future__ import annotations

import json
import logging
import re

from typing import Callable

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.routing import APIRoute
from starlette.responses import Response

from engine.errors import (EngineUnavailableError, InvalidArgumentError, ModelSwitchingError,
                           PromptTooLongError)

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


# ---- engine errors -> HTTP, by type -----------------------------------------------------------
# (type, status, code, message). The first row whose type the error is an instance of wins, so
# the specific rows come first. Only the type decides the status and code; the engine's message
# is passed on as it is (wrapped for the 503s and 500s), so rewording it changes nothing here.
RETRY_AFTER_S = 5
ENGINE_ERRORS: tuple[tuple[type, int, str | None, str], ...] = (
    (PromptTooLongError, 400, "context_length_exceeded", "{e}"),
    (InvalidArgumentError, 400, None, "{e}"),   # the processor's refusals name their field
    (ModelSwitchingError, 503, "model_switching", "{e}"),
    (EngineUnavailableError, 503, "engine_unavailable",
     "the engine is restarting (model switch or shutdown): {e}; retry in a few seconds"),
    (BaseException, 500, "engine_error",
     "the engine failed while running this request: {name}: {e}"),
)


def engine_row(e: BaseException) -> tuple[type, int, str | None, str]:
    return next(row for row in ENGINE_ERRORS if isinstance(e, row[0]))


def from_engine(e: BaseException, param_of: Callable[[str | None], str | None] = lambda p: p,
                default_param: str | None = None, request_id: str | None = None) -> APIError:
    """The APIError for an exception the engine raised. `param_of` maps the engine argument an
    InvalidArgumentError names (e.param) to the request field it came from; a 400 without one
    gets `default_param`. Anything but a typed client error is a 500 naming `request_id` (the
    server's log has it): an internal ValueError is the server's fault, not the client's."""
    _, status, code, template = engine_row(e)
    if status == 500:
        rid = request_id or new_error_id()
        log.error("request %s failed in the engine: %r", rid, e)
        template += f" (request id {rid})"
    param = None
    if status == 400:
        named = e.param if isinstance(e, InvalidArgumentError) else None
        param = param_of(named) if named is not None else default_param
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return APIError(status, template.format(e=e, name=type(e).__name__), param, code, headers)


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
            except EngineUnavailableError as e:     # a model loading, the engine shut down
                return from_engine(e).response()
            except StarletteHTTPException as e:    # FastAPI's own refusal (a body it cannot
                return APIError(e.status_code, str(e.detail),   # parse): the client's error
                                headers=dict(e.headers or {})).response()
            except Exception as e:     # a bug or an engine failure: say what, keep the server up
                rid = new_error_id()
                log.exception("unhandled error in %s (request id %s)", request.url.path, rid)
                return APIError(500, f"internal error: {type(e).__name__}: {e} (request id "
                                     f"{rid}; the server's log has the details)",
                                code="internal_error").response()
        return route_handler


def new_error_id() -> str:
    """An id for an internal error, logged with its traceback and named in the response."""
    import secrets
    return f"err-{secrets.token_hex(6)}"


# ---- unknown routes and methods: OpenAI's shape under /v1 --------------------------------------
_HTTP_MESSAGES = {404: "Not found: {method} {path} is not a route of this server (GET /v1/models, "
                       "POST /v1/chat/completions, POST /v1/completions, POST /v1/responses)",
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

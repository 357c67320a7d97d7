"""The OpenAI-compatible routes as one FastAPI APIRouter over "whatever engine is current".

`engines` is the serving hub (engine/serving.py; the playground's EngineHub is one), whose
`.llm` is replaced on a model switch and whose `.switching` is set meanwhile (503 while true).
Each request reads `.llm` once and keeps that engine to its end.
"""
from __future__ import annotations

import itertools
import os
import secrets
import time
from collections import OrderedDict

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse

from .auth import bearer_check
from .errors import APIError, OpenAIRoute
from .limits import Limits, Pools, check_stop_limits, parse_body
from .protocol import ChatCompletionRequest, CompletionRequest
from engine.serving import ServingHub

from .responses import Meta
from .sampling import chat_messages, completion_prompt, logprobs_of, probe_spec, sampling_params
from .serving import ClientGone, collect, sse_events, start
from .streaming import SSE_HEADERS
from .traces import trace_zip


class EngineHolder(ServingHub):
    """A serving hub over one engine with no other model to switch to (benchmarks, tests)."""


def served_names(llm) -> list[str]:
    """Names a request may use for the model: its short name, and the hub id it was loaded
    by. Never a filesystem path: the server's directories are nobody's business."""
    names = [llm.model_name]
    given = getattr(getattr(llm, "config", None), "model", None)
    if given and str(given) not in names and not os.path.isabs(str(given)) and \
            not os.path.exists(str(given)):
        names.append(str(given))
    return names


MAX_TRACE_OWNERS = 4096


def principal(request: Request) -> str:
    """Who asks, for trace privacy: the API key's holder, or (no key) any local client. A
    page's chat replies belong to its browser session, never to an API principal."""
    return "api-key" if request.scope.get("glassbox.auth") in ("bearer", "cookie") else "api"


def build_router(engines, api_key: str | None = None, *, limits: Limits | None = None,
                 pools: Pools | None = None, public_traces: bool = False) -> APIRouter:
    """`limits`/`pools`: the server's bounds and worker pools (its own when not given).
    `public_traces`: every client may list and read every trace (the chat's too); by default a
    client sees only the traces of requests it made."""
    router = APIRouter(route_class=OpenAIRoute, dependencies=[Depends(bearer_check(api_key))])
    limits = limits or Limits()
    pools = pools or Pools(limits)
    owners: OrderedDict[str, str] = OrderedDict()     # traced request id -> its principal
    started = int(time.time())
    tag = secrets.token_hex(4)      # ids unique across restarts; the trailing counter gives
    counter = itertools.count()     # sequential requests distinct colours in the playground

    def current_engine(model: str | None = None):
        llm = engines.current()     # ModelSwitchingError -> 503 with Retry-After (api/errors)
        if model is not None and model not in served_names(llm):
            raise APIError(404, f"The model '{model}' does not exist: this server serves "
                                f"'{llm.model_name}' (GET /v1/models lists it)", "model",
                           "model_not_found")
        return llm

    def model_card(llm) -> dict:
        return {"id": llm.model_name, "object": "model", "created": started,
                "owned_by": "glassbox", "root": llm.model_name,
                "max_model_len": llm.max_model_len}

    def prepare(raw: bytes, model_cls, chat: bool):
        """Parse and validate a request (on the prepare pool, never the event loop)."""
        body = parse_body(raw, model_cls)
        check_stop_limits(body.stop, body.stop_token_ids, limits)
        llm = current_engine(body.model)
        sampling = sampling_params(body, llm.max_model_len)
        prompt = chat_messages(body) if chat else completion_prompt(body)
        from .interventions import interventions_of
        return body, llm, sampling, prompt, probe_spec(body), interventions_of(body, llm)

    async def run(request: Request, model_cls, chat: bool) -> Response:
        raw = await request.body()        # bounded by api.guard before it was read
        body, llm, sampling, prompt, watch, ivs = await pools.run_prepare(
            lambda: prepare(raw, model_cls, chat))
        del raw
        want_lp, top_n = logprobs_of(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{tag}-{next(counter)}"
        if watch is not None:
            owners[rid] = principal(request)
            while len(owners) > MAX_TRACE_OWNERS:
                owners.popitem(last=False)
        meta = Meta(rid, int(time.time()), llm.model_name, watched=watch is not None)
        include_usage = bool(body.stream and body.stream_options
                             and body.stream_options.include_usage)
        try:
            job = await start(llm, prompt, sampling, watch, meta, request, chat=chat,
                              want_logprobs=want_lp, top_n=top_n, include_usage=include_usage,
                              prompt_param="messages" if chat else "prompt", pools=pools,
                              interventions=ivs)
            if body.stream:
                return StreamingResponse(sse_events(job), media_type="text/event-stream",
                                         headers=SSE_HEADERS)
            return JSONResponse(await collect(job, request))
        except ClientGone:
            return Response(status_code=499)    # nobody reads it: the client closed the socket

    @router.get("/v1/models")
    async def list_models():
        return JSONResponse({"object": "list", "data": [model_card(current_engine())]})

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        return JSONResponse(model_card(current_engine(model)))

    # the body is read and validated by `run` on the prepare pool (not by FastAPI on the loop)
    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, ChatCompletionRequest, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, CompletionRequest, chat=False)

    def readable(request: Request, request_id: str) -> bool:
        return public_traces or owners.get(request_id) == principal(request)

    @router.get("/v1/glassbox/traces")
    async def list_traces(request: Request):
        """Request ids with a trace (newest first) that this client may read: the watched
        requests it made (with --public-traces: every one, chat replies included)."""
        llm = current_engine()
        ids = await run_in_threadpool(llm.traced_requests)
        return JSONResponse({"object": "list", "data": [{"id": i} for i in ids
                                                        if readable(request, i)]})

    @router.get("/v1/glassbox/traces/{request_id}")
    async def export_trace(request_id: str, request: Request):
        """The trace as a zip of `<id>.npz` + `<id>.json` (RequestTrace.load reads them)."""
        if not readable(request, request_id):       # another client's: as if it did not exist
            raise APIError(404, f"no trace {request_id!r} of yours: a trace is readable by the "
                                "client that made it (the server's --public-traces shares all)",
                           "request_id", "trace_not_found")
        data = await run_in_threadpool(trace_zip, current_engine(), request_id)
        return Response(data, media_type="application/zip", headers={
            "Content-Disposition": f'attachment; filename="{request_id}.zip"'})

    return router

"""The OpenAI-compatible routes as one FastAPI APIRouter over "whatever engine is current".

`engines` is any object with an `.llm` attribute (the playground's EngineHub, whose `.llm` is
replaced on a model switch, or a plain `EngineHolder`) and optionally a `.switching` flag (503
while true). Each request reads `.llm` once and keeps that engine to its end.
"""
from __future__ import annotations

import itertools
import secrets
import time

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse

from .auth import bearer_check
from .errors import APIError, OpenAIRoute
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import Meta
from .sampling import chat_messages, completion_prompt, logprobs_of, probe_spec, sampling_params
from .serving import ClientGone, collect, sse_events, start
from .streaming import SSE_HEADERS
from .traces import trace_zip


class EngineHolder:
    """The smallest `engines` object: one engine that never switches (benchmarks, tests)."""

    def __init__(self, llm):
        self.llm = llm
        self.switching = False


def served_names(llm) -> list[str]:
    """Names a request may use for the model: its short name, and the path or hub id given."""
    names = [llm.model_name]
    for n in (getattr(getattr(llm, "config", None), "model", None),
              getattr(llm, "model_path", None)):
        if n and str(n) not in names:
            names.append(str(n))
    return names


def build_router(engines, api_key: str | None = None) -> APIRouter:
    router = APIRouter(route_class=OpenAIRoute, dependencies=[Depends(bearer_check(api_key))])
    started = int(time.time())
    tag = secrets.token_hex(4)      # ids unique across restarts; the trailing counter gives
    counter = itertools.count()     # sequential requests distinct colours in the playground

    def current_engine(model: str | None = None):
        if getattr(engines, "switching", False):
            raise APIError(503, "the model is being switched in the playground; retry in a few "
                                "seconds", code="model_switching", headers={"Retry-After": "5"})
        llm = engines.llm
        if model is not None and model not in served_names(llm):
            raise APIError(404, f"The model '{model}' does not exist: this server serves "
                                f"'{llm.model_name}' (GET /v1/models lists it)", "model",
                           "model_not_found")
        return llm

    def model_card(llm) -> dict:
        return {"id": llm.model_name, "object": "model", "created": started,
                "owned_by": "glassbox", "root": str(getattr(llm, "model_path", llm.model_name)),
                "max_model_len": llm.max_model_len}

    async def run(body, request: Request, chat: bool) -> Response:
        llm = current_engine(body.model)
        sampling = sampling_params(body, llm.max_model_len)
        prompt = chat_messages(body) if chat else completion_prompt(body)
        watch = probe_spec(body)
        from .interventions import interventions_of
        ivs = interventions_of(body, llm)
        want_lp, top_n = logprobs_of(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{tag}-{next(counter)}"
        meta = Meta(rid, int(time.time()), llm.model_name, watched=watch is not None)
        include_usage = bool(body.stream and body.stream_options
                             and body.stream_options.include_usage)
        try:
            job = await start(llm, prompt, sampling, watch, meta, request, chat=chat,
                              want_logprobs=want_lp, top_n=top_n, include_usage=include_usage,
                              prompt_param="messages" if chat else "prompt",
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

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(body, request, chat=True)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(body, request, chat=False)

    @router.get("/v1/glassbox/traces")
    async def list_traces():
        """Request ids with a trace (newest first): watched API requests and chat replies."""
        llm = current_engine()
        ids = await run_in_threadpool(llm.traced_requests)
        return JSONResponse({"object": "list", "data": [{"id": i} for i in ids]})

    @router.get("/v1/glassbox/traces/{request_id}")
    async def export_trace(request_id: str):
        """The trace as a zip of `<id>.npz` + `<id>.json` (RequestTrace.load reads them)."""
        data = await run_in_threadpool(trace_zip, current_engine(), request_id)
        return Response(data, media_type="application/zip", headers={
            "Content-Disposition": f'attachment; filename="{request_id}.zip"'})

    return router

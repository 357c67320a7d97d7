"""The OpenAI-compatible routes as one FastAPI APIRouter over "whatever engine is current".

`engines` is the serving hub (engine/serving.py; the playground's EngineHub is one), whose
`.llm` is replaced on a model switch and whose `.switching` is set meanwhile (503 while true).
Each request reads `.llm` once and keeps that engine to its end.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import OrderedDict

from fastapi import APIRouter, Depends, Request

from engine.errors import InvalidArgumentError
from engine.processor import Prompt
from engine.serving import ServingHub
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse

from .auth import bearer_check
from .chat_template import chat_options, reply_parsing
from .errors import APIError, OpenAIRoute, bad_request
from .generation_config import model_defaults
from .interventions import interventions_of
from .limits import (Limits, Pools, check_cost, check_logprob_cost, check_stop_limits,
                     parse_body)
from .metrics import EngineMetrics
from .model_names import hub_names, listed_name, served_names as accepted_names
from .ops import build_ops_routers
from .protocol import ChatCompletionRequest, CompletionRequest
from .response_store import ResponseStore
from .responses import Meta
from .responses_api import add_responses_routes
from .sampling import (chat_echo_text, chat_messages, completion_prompts, logprobs_of,
                       probe_spec, refuse_unsupported, request_param, sampling_params)
from .serving import (ChoiceSpec, ClientGone, collect, engine_error, reply_json, sse_events,
                      start)
from .streaming import SSE_HEADERS
from .structured import grammar_of
from .traces import trace_zip

log = logging.getLogger("glassbox.api")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")     # printable ASCII, no spaces


class EngineHolder(ServingHub):
    """A serving hub over one engine with no other model to switch to (benchmarks, tests)."""


MAX_TRACE_OWNERS = 4096


def principal(request: Request) -> str:
    """Who asks, for trace privacy: the API key's holder, or (no key) any local client. A
    page's chat replies belong to its browser session, never to an API principal."""
    return "api-key" if request.scope.get("glassbox.auth") in ("bearer", "cookie") else "api"


def prefix_cache_salt(request: Request, body) -> str:
    """The salt of a request's prefix-cache chain on a server that isolates its users: who asks
    (the key's holder, or any local client) and the OpenAI `user` field they send, with the
    request's own `cache_salt`. Requests of different users never share cached blocks, so a
    faster first token tells nobody what another user sent (the timing side channel)."""
    import hashlib

    from engine.cache_salt import check_salt
    try:
        check_salt(body.cache_salt)
    except InvalidArgumentError as e:
        raise bad_request(str(e), "cache_salt") from None
    who = f"{principal(request)}\x1f{body.user or ''}\x1f{body.cache_salt or ''}"
    return hashlib.sha256(who.encode("utf-8", "surrogatepass")).hexdigest()


def build_router(engines, api_key: str | None = None, *, limits: Limits | None = None,
                 pools: Pools | None = None, public_traces: bool = False,
                 isolate_prefix_cache: bool = False) -> APIRouter:
    """`limits`/`pools`: the server's bounds and worker pools (its own when not given).
    `public_traces`: every client may list and read every trace (the chat's too); by default a
    client sees only the traces of requests it made. `isolate_prefix_cache`: salt every
    request's prefix-cache chain by its user (prefix_cache_salt)."""
    auth = bearer_check(api_key)
    metrics = EngineMetrics(engines)        # /metrics: listens to each engine it sees
    router = APIRouter(route_class=OpenAIRoute, dependencies=[Depends(auth)])
    limits = limits or Limits()
    pools = pools or Pools(limits)
    owners: OrderedDict[str, str] = OrderedDict()     # traced request id -> its principal
    started = int(time.time())

    def client_request_id(request: Request) -> str | None:
        """The client's X-Request-Id: echoed on the reply (vLLM does), never the engine's key
        (the server makes its ids: a client that knew or chose them could squat another's)."""
        given = request.headers.get("x-request-id")
        if given is not None and not _REQUEST_ID.fullmatch(given):
            raise bad_request("X-Request-Id must be 1 to 128 printable ASCII characters without "
                              f"spaces, got {given!r:.200}", "X-Request-Id")
        return given

    def current_engine(model: str | None = None):
        engines.current()           # ModelSwitchingError -> 503 with Retry-After (api/errors)
        llm = metrics.attach()      # after a model switch: the new engine's requests count
        if model is not None and model not in accepted_names(llm, hub_names(engines)):
            raise APIError(404, f"The model '{model}' does not exist: this server serves "
                                f"'{listed_name(llm, hub_names(engines))}'", "model",
                           "model_not_found")
        return llm

    def model_card(llm) -> dict:
        return {"id": listed_name(llm, hub_names(engines)), "object": "model", "created": started,
                "owned_by": "glassbox", "root": llm.model_name,
                "max_model_len": llm.max_model_len}

    def choice_specs(body, llm, rid: str, prompts: list, tokenized: list, watch, chat: bool,
                     salt: str | None) -> list[ChoiceSpec]:
        """One ChoiceSpec per (prompt, n), each an EngineRequest from the engine's processor
        (checked once, there); index = prompt * n + j, as vLLM numbers them. The request's
        engine ids are the server's own (`rid`), never a client's."""
        n, defaults, specs = body.n, model_defaults(llm), []
        grammar, kind = grammar_of(body)
        ivs = interventions_of(body)
        echo = isinstance(body, CompletionRequest) and body.echo
        proc = llm.processor
        for i, prompt in enumerate(tokenized):
            params = sampling_params(body, llm.max_model_len, len(prompt), defaults, grammar)
            echo_text = None
            if echo:        # the prompt as sent; token ids as the tokenizer reads them
                echo_text = prompts[i] if isinstance(prompts[i], str) else (
                    llm.tokenizer.decode(list(prompt.token_ids))
                    if llm.tokenizer is not None else "")
            first = None
            for j in range(n):
                idx = i * n + j
                p = params
                if j and params.seed is not None:   # seeded copies must not all draw the same
                    p = dataclasses.replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)
                engine_id = rid if n * len(tokenized) == 1 else f"{rid}-{idx}"
                if first is None:
                    try:
                        first = req = proc.process(
                            prompt, p, watch=watch if idx == 0 else None, interventions=ivs,
                            cache_salt=salt, request_id=engine_id,
                            group=rid if n * len(tokenized) > 1 else None,
                            priority=body.priority)
                    except InvalidArgumentError as e:   # names its field
                        raise bad_request(str(e), request_param(
                            e.param, chat, guided=kind)) from None
                else:               # a copy: the same checked request, its own grammar
                    req = proc.fork(first, engine_id, p)
                specs.append(ChoiceSpec(idx, i, req, copy=j > 0, echo_text=echo_text,
                                        echo_only=echo and body.max_tokens == 0))
        return specs

    def prepare(raw: bytes, parse, chat: bool, path: str, salt_of, id_prefix: str | None):
        """Parse the body (`parse(raw)`: a model class, or a function that builds the chat
        request, the Responses API's) and run the engine's processor on every choice: on the
        prepare pool, never the event loop (a long prompt takes a while to tokenize; other
        streams' tokens must not wait)."""
        body = parse_body(raw, parse) if isinstance(parse, type) else parse(raw)
        check_stop_limits(body.stop, body.stop_token_ids, limits)
        llm = current_engine(body.model)
        ignored = body.ignored_fields()
        if ignored:
            log.warning("%s: ignoring unknown fields %s", path, ", ".join(ignored))
        refuse_unsupported(body)        # before the prompt is rendered: clearer errors first
        check_cost(body, chat, limits)
        rid = llm.processor.new_request_id(id_prefix or ("chatcmpl" if chat else "cmpl"))
        prompts = [chat_messages(body)] if chat else completion_prompts(body)
        param = "messages" if chat else "prompt"
        keep = body.truncate_prompt_tokens      # vLLM's: the prompt's last `keep` tokens
        keep = llm.max_model_len if keep == -1 else keep
        if keep is not None and not chat:       # token ids: before the engine's length check;
            prompts = [p[-keep:] if isinstance(p, list) else p for p in prompts]  # echo shows these
        parsing = None
        try:
            if chat:
                tokenized = [llm.processor.tokenize(prompts[0], chat_options(body))]
                parsing = reply_parsing(llm, body, tokenized[0].rendered)
            else:
                tokenized = [llm.processor.tokenize(p) for p in prompts]
        except InvalidArgumentError as e:
            raise engine_error(e, param, chat) from None
        if keep is not None:                    # text and chat: after tokenizing
            for i, one in enumerate(tokenized):
                if len(one) > keep:
                    tokenized[i] = Prompt(one.token_ids[-keep:], None, one.rendered)
                    if not chat:                # echo shows the prompt the model read
                        prompts[i] = list(tokenized[i].token_ids)
        watch = probe_spec(body)
        salt = salt_of(body) if isolate_prefix_cache else body.cache_salt
        specs = choice_specs(body, llm, rid, prompts, tokenized, watch, chat, salt)
        want_lp, top_n = logprobs_of(body)
        check_logprob_cost(specs, top_n, want_lp, limits)
        return body, llm, rid, specs, watch, parsing, param

    async def open_job(request: Request, parse, chat: bool, id_prefix: str | None = None):
        """The request parsed, checked and started in the engine: (body, job, headers), once
        every choice produced its first token. Raises ClientGone or the request's APIError."""
        given_id = client_request_id(request)
        raw = await request.body()        # bounded by api.guard before it was read
        body, llm, rid, specs, watch, parsing, param = await pools.run_prepare(
            lambda: prepare(raw, parse, chat, request.url.path,
                            lambda body: prefix_cache_salt(request, body), id_prefix))
        del raw
        want_lp, top_n = logprobs_of(body)
        meta = Meta(rid, int(time.time()), listed_name(llm, hub_names(engines)),
                    watched=watch is not None)   # vLLM: the served name
        include_usage = bool(body.stream and body.stream_options
                             and body.stream_options.include_usage)
        continuous_usage = include_usage and body.stream_options.continuous_usage_stats
        # the server's id; a client's X-Request-Id is echoed, never the engine's key
        headers = {"X-Request-Id": given_id or rid}
        job = await start(llm, specs, meta, request, pools=pools,
                          chat=chat, want_logprobs=want_lp, top_n=top_n,
                          include_usage=include_usage, prompt_param=param,
                          continuous_usage=continuous_usage,
                          want_prompt_logprobs=body.prompt_logprobs is not None,
                          return_token_ids=bool(body.return_token_ids),
                          chat_echo=chat_echo_text(body) if chat else "",
                          tokens_as_ids=bool(getattr(body, "return_tokens_as_token_ids", False)),
                          parsing=parsing if parsing is not None and parsing.active else None)
        if watch is not None:       # only an accepted request's trace has an owner
            owners[specs[0].request_id] = principal(request)
            while len(owners) > MAX_TRACE_OWNERS:
                owners.popitem(last=False)
        return body, job, headers

    async def run(request: Request, model_cls, chat: bool) -> Response:
        try:
            body, job, headers = await open_job(request, model_cls, chat)
            if body.stream:
                return StreamingResponse(sse_events(job), media_type="text/event-stream",
                                         headers={**SSE_HEADERS, **headers})
            return await reply_json(await collect(job, request), headers)
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

    add_responses_routes(router, open_job, ResponseStore())

    open_ops, keyed_ops = build_ops_routers(engines, current_engine, auth, metrics)
    # each route carries its own router's dependencies (the key or none): one list of routes
    router.routes[:0] = open_ops.routes + keyed_ops.routes
    return router

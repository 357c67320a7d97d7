"""The Responses API: POST /v1/responses (streamed as the openai SDK's typed events, or whole),
GET and DELETE /v1/responses/{id} for stored responses.

A request is served by the chat path: api.responses_items turns it into a chat request, which
the routes' `open_job` parses, checks, renders with the chat template and starts in the engine
(through the same Processor, watched in the playground's tabs like every API request);
api.responses_output builds the output items from the reply. Errors are the chat path's 400s,
naming the Responses field (input, max_output_tokens, text.format, ...)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .chat_parsing import tool_calls_note
from .errors import APIError
from .response_store import ResponseStore, owner_of
from .responses_items import (chat_request, listed_items, parse_responses_request,
                              response_id_param)
from .responses_output import OutputBuilder
from .serving import ClientGone, engine_error
from .streaming import SSE_HEADERS, sse


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found: responses are kept in "
                         "memory for a while, and only for the API key that created them",
                    "response_id", "response_not_found")


def sse_event(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\n" + sse(event)


def logprobs_of(job, ev) -> list[dict]:
    """The event's token logprobs in chat's (and the Responses API's) shape, when asked for."""
    if not job.want_logprobs or ev.logprobs is None:
        return []
    return job.logprobs_for([ev.logprobs])["content"]


def response_fields(req, job, created: int) -> dict:
    """The response object's fields that do not change while it is generated."""
    chat = job.choices[0].spec.params
    return {"id": job.meta.id, "object": "response", "created_at": created,
            "model": job.meta.model, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
            "store": req.store, "temperature": chat.temperature, "top_p": chat.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "truncation": req.truncation or "disabled", "user": req.user,
            "glassbox": job.meta.glassbox()}


def add_responses_routes(router: APIRouter, open_job, store: ResponseStore) -> None:
    """`open_job(request, parse, chat, id_prefix)`: the routes' own start of a request
    (api.routes: parsed, checked and started in the engine as a chat request is)."""

    def parser(request: Request, kept: dict):
        """raw body -> the chat request (on the prepare pool); `kept`: the Responses request and
        the conversation to store, for the reply."""
        owner = owner_of(request)

        def parse(raw: bytes):
            try:
                return to_chat(raw)
            except APIError as e:   # named by its Responses field already
                e.responses_param = True
                raise

        def to_chat(raw: bytes):
            req = parse_responses_request(raw)
            history = []
            if req.previous_response_id is not None:
                prev = store.get(owner, req.previous_response_id)
                if prev is None:
                    raise APIError(404, f"Previous response with id "
                                        f"{req.previous_response_id!r} not found: responses "
                                        "are kept in memory for a while (store: true), and "
                                        "only for the API key that created them",
                                   "previous_response_id", "previous_response_not_found")
                history = list(prev.messages)
            body, conversation = chat_request(req, history)
            kept.update(req=req, conversation=conversation, owner=owner,
                        input_items=listed_items(req.input))
            return body
        return parse

    def keep(kept: dict, builder: OutputBuilder) -> None:
        req = kept["req"]
        if req.store:
            store.put(kept["owner"], builder.body(),
                      kept["conversation"] + [builder.reply_message()], kept["input_items"])

    async def stream(job, builder: OutputBuilder, kept: dict):
        ch = job.choices[0]
        llm = ch.stream.llm
        try:
            yield b"".join(sse_event(e) for e in builder.start())
            async for items in ch.stream.batches():
                out = []
                for ev in items:
                    if isinstance(ev, BaseException):
                        err = engine_error(ev, "input", True, ch.spec.request_id)
                        out.append(sse_event(builder.event(
                            "error", code=err.code, message=err.message,
                            param=response_id_param(err.param))))
                        yield b"".join(out)
                        return
                    ch.reply.add(ev)
                    calls = len(builder.parser.calls)
                    events = builder.feed(ev.text, ev.token_id is not None,
                                          logprobs_of(job, ev))
                    if len(builder.parser.calls) > calls and not ev.finished:
                        llm.annotate(ch.spec.request_id, tool_calls_note(builder.parser.calls))
                    if ev.finished:
                        job.finish(ch)
                        r = ch.reply
                        events += builder.finish(r.finish_reason, r.prompt_tokens,
                                                 r.completion_tokens)
                        keep(kept, builder)
                    out += [sse_event(e) for e in events]
                if out:
                    yield b"".join(out)
        finally:
            job.close()

    async def whole(job, builder: OutputBuilder, kept: dict, request: Request) -> dict:
        ch = job.choices[0]
        if not await ch.stream.wait_end(request):
            job.close()
            raise ClientGone()
        for ev in ch.stream.drain():
            if isinstance(ev, BaseException):
                job.close()
                raise engine_error(ev, "input", True, ch.spec.request_id)
            ch.reply.add(ev)
            builder.feed(ev.text, ev.token_id is not None, logprobs_of(job, ev))
        job.finish(ch)
        r = ch.reply
        builder.finish(r.finish_reason, r.prompt_tokens, r.completion_tokens)
        keep(kept, builder)
        return builder.body()

    @router.post("/v1/responses")
    async def create_response(request: Request):
        kept: dict = {}
        created = int(time.time())
        try:
            body, job, headers = await open_job(request, parser(request, kept), True, "resp")
        except ClientGone:
            return Response(status_code=499)
        except APIError as e:       # the chat path's field names -> the Responses API's
            if not getattr(e, "responses_param", False):
                e.param = response_id_param(e.param)
            raise
        builder = OutputBuilder(job.parsing, response_fields(kept["req"], job, created))
        if body.stream:
            return StreamingResponse(stream(job, builder, kept), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **headers})
        try:
            return JSONResponse(await whole(job, builder, kept, request), headers=headers)
        except ClientGone:
            return Response(status_code=499)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        item = store.get(owner_of(request), response_id)
        if item is None:
            raise not_found(response_id)
        return JSONResponse(item.body)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request, order: str = "desc",
                               limit: int = 20, after: str | None = None):
        """The stored response's input items (this request's, not its predecessors'), a page
        of at most `limit` (1 to 100) after the item `after`, newest first unless order=asc."""
        item = store.get(owner_of(request), response_id)
        if item is None:
            raise not_found(response_id)
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be between 1 and 100, got {limit}", "limit")
        items = item.input_items if order == "asc" else item.input_items[::-1]
        if after is not None:
            ids = [x["id"] for x in items]
            if after not in ids:
                raise APIError(400, f"no input item {after!r} in response {response_id!r}",
                               "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(items) > limit})

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        if not store.delete(owner_of(request), response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

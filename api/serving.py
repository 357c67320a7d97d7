"""One API request through the engine: start its EngineStream, then either stream SSE chunks
or collect the whole reply. Engine errors become OpenAI errors; a client that leaves aborts."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from .errors import APIError, from_engine
from .logprobs import TokenStrings, chat_entry, completion_logprobs
from .responses import (Meta, Reply, TokenChunks, chat_chunk, chat_completion, completion,
                        completion_chunk, usage_chunk)
from .sampling import request_param
from .streaming import SSE_DONE, EngineStream, sse

_STRINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_strings(llm) -> TokenStrings:
    """One cached id -> text/bytes table per engine."""
    s = _STRINGS.get(llm)
    if s is None:
        s = _STRINGS[llm] = TokenStrings(llm.tokenizer)
    return s


class ClientGone(Exception):
    """The client disconnected before the reply was ready; its request was aborted."""


def engine_error(e: BaseException, prompt_param: str, chat: bool) -> APIError:
    """The OpenAI error for what the engine raised, by its type (api/errors.ENGINE_ERRORS); the
    engine argument it names becomes the request's field (the prompt's: `prompt_param`)."""
    return from_engine(e, lambda p: request_param(p, chat), prompt_param)


@dataclass
class Job:
    """A request on its way through the engine, and how to render it."""
    chat: bool
    meta: Meta
    stream: EngineStream
    want_logprobs: bool
    top_n: int
    strings: TokenStrings
    include_usage: bool = False
    prompt_param: str = "messages"

    def logprobs_for(self, lps: list, offset: int = 0) -> dict | None:
        """`offset`: characters of the reply before these tokens (completions' text_offset)."""
        if not self.want_logprobs or not lps:
            return None
        if self.chat:
            return {"content": [chat_entry(lp, self.top_n, self.strings) for lp in lps]}
        return completion_logprobs(lps, self.top_n, self.strings, offset)


async def start(llm, prompt, sampling, watch, meta: Meta, request, pools=None,
                interventions=None, **render) -> Job:
    """Submit the request; returns once the engine produced its first token (or raises the
    400 that its prompt deserves, before any header is sent). `render`: Job's other fields;
    `pools`: the server's worker pools (api.limits.Pools); `interventions`: the request's
    Intervention specs (engine/interventions)."""
    stream = EngineStream(llm, prompt, sampling, watch, meta.id, pools, interventions)
    job = Job(meta=meta, stream=stream, strings=token_strings(llm), **render)
    if not await stream.wait_first(request):
        stream.close()
        raise ClientGone()
    err = stream.first_error()
    if err is not None:
        raise engine_error(err, job.prompt_param, job.chat)
    return job


async def collect(job: Job, request) -> dict:
    """The whole reply as one response body."""
    if not await job.stream.wait_end(request):
        job.stream.close()
        raise ClientGone()
    reply = Reply()
    for item in job.stream.drain():
        if isinstance(item, BaseException):
            raise engine_error(item, job.prompt_param, job.chat)
        reply.add(item)
    lps = job.logprobs_for(reply.logprobs)
    return chat_completion(job.meta, reply, lps) if job.chat else completion(job.meta, reply, lps)


async def sse_events(job: Job):
    """The reply as server-sent events; closing this generator (client gone) aborts it."""
    meta, usage = job.meta, job.include_usage
    reply = Reply()
    # no tokenizer (token-id engines): every token is a chunk, though its text is empty
    every_token = job.strings.tokenizer is None
    token_chunk = TokenChunks(meta, job.chat, usage)
    try:
        if job.chat:
            first = chat_chunk(meta, {"role": "assistant", "content": ""}, with_usage=usage)
            first["glassbox"] = meta.glassbox()
            yield sse(first)
        first_token = not job.chat
        async for items in job.stream.batches():
            out = []
            for ev in items:
                if isinstance(ev, BaseException):
                    out.append(sse(engine_error(ev, job.prompt_param, job.chat).body()))
                    out.append(SSE_DONE)
                    yield b"".join(out)
                    return
                lps = job.logprobs_for([ev.logprobs] if ev.logprobs is not None else [],
                                       len(reply.text))
                reply.add(ev)
                if not (ev.finished or ev.text or lps or every_token):
                    continue        # text held back (a possible stop string, a partial char)
                if not (ev.finished or lps or first_token):     # the common case, fast
                    out.append(token_chunk(ev.text))
                    continue
                reason = ev.finish_reason if ev.finished else None
                if job.chat:
                    delta = {"content": ev.text} if ev.text or not ev.finished else {}
                    chunk = chat_chunk(meta, delta, reason, lps, usage)
                else:
                    chunk = completion_chunk(meta, ev.text, reason, lps, usage)
                if first_token:
                    chunk["glassbox"] = meta.glassbox()
                    first_token = False
                out.append(sse(chunk))
            if out:
                yield b"".join(out)
        if usage:
            yield sse(usage_chunk(meta, "chat.completion.chunk" if job.chat
                                  else "text_completion", reply))
        yield SSE_DONE
    finally:
        job.stream.close()

"""One API request through the engine: start an EngineStream per choice (prompts x n), then
either stream SSE chunks (the choices' streams merged, each chunk naming its choice) or collect
the whole reply. Engine errors become OpenAI errors; a client that leaves aborts every choice.

n > 1: the first choice of each prompt is submitted alone; once it produced its first token its
prompt's full KV blocks are in the prefix cache, and the other n - 1 are submitted then, so they
reuse those blocks instead of each computing the prompt (only the last partial block and the
newest token are computed again per copy: the copies' prefill is not one shared step).
"""
from __future__ import annotations

import asyncio
import json
import weakref
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response


from .chat_parsing import ChatDeltaParser, split_reply, tool_calls_note
from .errors import APIError, from_engine
from .logprobs import (TokenStrings, chat_entry, completion_logprobs, echo_logprobs,
                       join_logprobs, vllm_prompt_logprobs)
from .responses import (Meta, Reply, TokenChunks, chat_chunk, chat_choice, chat_completion,
                        completion, completion_chunk, completion_choice, usage, usage_chunk)
from .sampling import request_param
from .streaming import SSE_DONE, EngineStream, sse

_STRINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_strings(llm, as_ids: bool = False) -> TokenStrings:
    """One cached id -> text/bytes table per engine; `as_ids`: logprob tokens named
    `token_id:N` (vLLM's return_tokens_as_token_ids; a table of its own, uncached)."""
    if as_ids:
        return TokenStrings(llm.tokenizer, as_ids=True)
    s = _STRINGS.get(llm)
    if s is None:
        s = _STRINGS[llm] = TokenStrings(llm.tokenizer)
    return s


class ClientGone(Exception):
    """The client disconnected before the reply was ready; its request was aborted."""


def engine_error(e: BaseException, prompt_param: str, chat: bool,
                 request_id: str | None = None) -> APIError:
    """The OpenAI error for what the engine raised, by its type (api/errors.ENGINE_ERRORS); the
    engine argument it names becomes the request's field (the prompt's: `prompt_param`)."""
    return from_engine(e, lambda p: request_param(p, chat), prompt_param, request_id)


@dataclass
class ChoiceSpec:
    """What to submit for one choice."""
    index: int                  # the choice's index in the response
    prompt_index: int           # which prompt of the request (usage counts each prompt once)
    request: object             # engine.processor.EngineRequest: checked and tokenized once
    copy: bool = False          # n > 1: submitted once the first choice's prompt is cached
    echo_text: str | None = None    # completions' echo: the prompt's text, shown before the reply
    echo_only: bool = False     # echo with max_tokens 0: the one token run is not shown

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt.token_ids

    @property
    def params(self):
        return self.request.params

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class Choice:
    spec: ChoiceSpec
    stream: EngineStream
    reply: Reply = field(default_factory=Reply)


def stop_reason_of(reply: Reply, params, tokenizer) -> int | str | None:
    """vLLM's stop_reason: the stop token id or stop string that ended the reply, None when it
    ended on EOS, on length, or was aborted."""
    if reply.finish_reason != "stop":
        return None
    last = reply.token_ids[-1] if reply.token_ids else None
    if last is not None and last in params.stop_token_ids:
        return last
    if not params.stop or tokenizer is None:
        return None
    full = tokenizer.decode(reply.token_ids, skip_special_tokens=params.skip_special_tokens)
    hits = [(i, k) for k, s in enumerate(params.stop)
            if (i := full.find(s, max(0, len(reply.text) - len(s)))) >= 0]
    return params.stop[min(hits)[1]] if hits else None


@dataclass
class Job:
    """A request on its way through the engine, and how to render it."""
    chat: bool
    meta: Meta
    want_logprobs: bool
    top_n: int
    strings: TokenStrings
    include_usage: bool = False
    prompt_param: str = "messages"
    want_prompt_logprobs: bool = False      # vLLM's `prompt_logprobs` field was set
    parsing: object = None      # chat_template.ReplyParsing: reasoning / tool-call split, or None
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids beside the text
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    chat_echo: str = ""         # vLLM's chat echo: the last message's text before each reply
    choices: list[Choice] = field(default_factory=list)

    def token_ids(self, ch: Choice) -> list[int]:
        """The choice's generated token ids (the stop token included, as vLLM's; none for echo
        with max_tokens 0, whose one token run is not shown)."""
        return [] if ch.spec.echo_only else list(ch.reply.token_ids)

    def logprobs_for(self, lps: list, offset: int = 0) -> dict | None:
        """`offset`: characters of the reply before these tokens (completions' text_offset)."""
        if not self.want_logprobs or not lps:
            return None
        if self.chat:
            return {"content": [chat_entry(lp, self.top_n, self.strings) for lp in lps]}
        return completion_logprobs(lps, self.top_n, self.strings, offset)

    def finish(self, ch: Choice) -> None:
        r = ch.reply
        r.stop_reason = stop_reason_of(r, ch.spec.params, self.strings.tokenizer)
        if ch.spec.echo_only:       # max_tokens 0: the token run to get there is not shown
            r.text, r.logprobs, r.completion_tokens = "", [], 0
            r.finish_reason, r.stop_reason = "length", None

    def echo_part(self, ch: Choice) -> tuple[str, dict | None]:
        """(the echoed prompt's text, its logprobs) of a completions choice with echo."""
        spec, r = ch.spec, ch.reply
        if spec.echo_text is None:
            return "", None
        lps = None
        if self.want_logprobs:
            lps = echo_logprobs(spec.prompt, r.prompt_logprobs or [None] * len(spec.prompt),
                                self.top_n, self.strings)
        return spec.echo_text, lps

    def prompt_logprobs(self, ch: Choice) -> list | None:
        if not self.want_prompt_logprobs or ch.reply.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(ch.reply.prompt_logprobs, self.strings)

    def render(self, ch: Choice) -> dict:
        """One choice of the whole response body."""
        r = ch.reply
        if self.chat:
            out = chat_choice(ch.spec.index, r, self.logprobs_for(r.logprobs))
            if self.parsing is not None:
                p = self.parsing
                reasoning, content, calls = split_reply(r.text, p.reasoning, p.tools,
                                                        p.in_reasoning)
                msg = out["message"]
                msg["content"] = content
                if p.reasoning:     # vLLM's current name, and the one older clients read
                    msg["reasoning"] = msg["reasoning_content"] = reasoning
                if p.tools:
                    msg["tool_calls"] = calls
                if calls and r.finish_reason == "stop":
                    out["finish_reason"] = "tool_calls"
            if self.chat_echo:
                msg = out["message"]
                msg["content"] = self.chat_echo + (msg["content"] or "")
            if self.return_token_ids:       # chat's prompt_token_ids are on the response
                out["token_ids"] = self.token_ids(ch)
            return out
        echo, echo_lps = self.echo_part(ch)
        lps = join_logprobs(echo_lps, self.logprobs_for(r.logprobs, len(echo)))
        out = completion_choice(ch.spec.index, r, lps, echo + r.text)
        if self.want_prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs(ch)
        if self.return_token_ids:
            out["prompt_token_ids"] = list(ch.spec.prompt)
            out["token_ids"] = self.token_ids(ch)
        return out

    def usage(self) -> dict:
        """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
        prompts = {c.spec.prompt_index: c.reply.prompt_tokens for c in self.choices}
        return usage(sum(prompts.values()), sum(c.reply.completion_tokens for c in self.choices))

    def close(self) -> None:
        for ch in self.choices:
            ch.stream.close()


async def start(llm, specs: list[ChoiceSpec], meta: Meta, request, pools=None,
                tokens_as_ids: bool = False, **render) -> Job:
    """Submit the request's choices; returns once each produced its first token (or raises the
    error its request deserves, before any header is sent). `render`: Job's other fields;
    `pools`: the server's worker pools (api.limits.Pools); `tokens_as_ids`: vLLM's
    return_tokens_as_token_ids."""
    job = Job(meta=meta, strings=token_strings(llm, tokens_as_ids), **render)
    meta.request_ids = [s.request_id for s in specs]
    for wave in ([s for s in specs if not s.copy], [s for s in specs if s.copy]):
        opened = [Choice(s, EngineStream(llm, s.request, pools)) for s in wave]
        job.choices += opened
        for ch in opened:
            if not await ch.stream.wait_first(request):
                job.close()
                raise ClientGone()
            err = ch.stream.first_error()
            if err is not None:
                job.close()
                raise engine_error(err, job.prompt_param, job.chat, ch.spec.request_id)
    job.choices.sort(key=lambda c: c.spec.index)
    return job


async def collect(job: Job, request) -> Job:
    """Wait until every choice has ended (the whole reply is in); `render_body` renders it."""
    for ch in job.choices:
        if not await ch.stream.wait_end(request):
            job.close()
            raise ClientGone()
    for ch in job.choices:
        for item in ch.stream.drain():
            if isinstance(item, BaseException):
                job.close()
                raise engine_error(item, job.prompt_param, job.chat, ch.spec.request_id)
            ch.reply.add(item)
        job.finish(ch)
    return job


def render_body(job: Job) -> dict:
    """The whole reply as one response body."""
    out = [job.render(ch) for ch in job.choices]
    body = (chat_completion if job.chat else completion)(job.meta, out, job.usage())
    if job.chat and job.want_prompt_logprobs:      # vLLM: chat's is on the response
        body["prompt_logprobs"] = job.prompt_logprobs(job.choices[0])
    if job.chat and job.return_token_ids:          # one conversation: one prompt
        body["prompt_token_ids"] = list(job.choices[0].spec.prompt)
    return body


# a reply with more tokens than this (x alternatives when logprobs are on) is rendered and
# encoded on a worker thread: building and encoding tens of MB of JSON on the event loop held
# every other stream and /health for seconds
HEAVY_REPLY_ENTRIES = 20_000


async def reply_json(job: Job, headers: dict) -> Response:
    """The whole reply as a JSON response; a heavy one rendered off the event loop."""
    entries = sum(len(ch.reply.token_ids) * (1 + job.top_n if job.want_logprobs else 1)
                  + (len(ch.spec.prompt) if job.want_prompt_logprobs else 0)
                  for ch in job.choices)
    if entries <= HEAVY_REPLY_ENTRIES:
        return JSONResponse(render_body(job), headers=headers)
    data = await run_in_threadpool(lambda: json.dumps(
        render_body(job), ensure_ascii=False, separators=(",", ":")).encode())
    return Response(data, media_type="application/json", headers=headers)


async def merged(job: Job):
    """(choice, items) as each choice's stream delivers them, until every stream ended."""
    if len(job.choices) == 1:
        ch = job.choices[0]
        async for items in ch.stream.batches():
            yield ch, items
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(ch: Choice):
        try:
            async for items in ch.stream.batches():
                q.put_nowait((ch, items))
        finally:
            q.put_nowait((ch, None))
    tasks = [asyncio.ensure_future(pump(ch)) for ch in job.choices]
    left = len(tasks)
    try:
        while left:
            ch, items = await q.get()
            if items is None:
                left -= 1
            else:
                yield ch, items
    finally:
        for t in tasks:
            t.cancel()


async def sse_events(job: Job):
    """The reply as server-sent events; closing this generator (client gone) aborts it."""
    meta, with_usage = job.meta, job.include_usage
    # no tokenizer (token-id engines): every token is a chunk, though its text is empty
    every_token = job.strings.tokenizer is None
    token_chunk = {id(ch): TokenChunks(meta, job.chat, with_usage, ch.spec.index)
                   for ch in job.choices}
    first_token = {id(ch): not job.chat for ch in job.choices}
    p = job.parsing
    parsers = {id(ch): ChatDeltaParser(p.reasoning, p.tools, p.in_reasoning)
               for ch in job.choices} if job.chat and p is not None else {}
    # return_token_ids: each choice's token ids not yet sent; they ride on its next chunk (a
    # token whose text is held back, a possible stop string, goes out with the text after it)
    ids_due = {id(ch): [] for ch in job.choices} if job.return_token_ids else None
    continuous = with_usage and job.continuous_usage

    def extras(ch, chunk: dict, ids: bool = True) -> dict:
        """The per-chunk extras a request asked for: its token ids due (return_token_ids) and
        the choice's usage so far (continuous_usage_stats)."""
        if ids and ids_due is not None:
            c = chunk["choices"][0]
            c["token_ids"], ids_due[id(ch)] = ids_due[id(ch)], []
            if not job.chat and not ch.reply.prompt_sent:   # completions: on the first chunk
                c["prompt_token_ids"], ch.reply.prompt_sent = list(ch.spec.prompt), True
        if continuous:
            done = 0 if ch.spec.echo_only else len(ch.reply.token_ids)
            chunk["usage"] = usage(len(ch.spec.prompt), done)
        return chunk
    try:
        if job.chat:
            first = []
            for ch in job.choices:
                c = chat_chunk(meta, {"role": "assistant", "content": ""},
                               with_usage=with_usage, index=ch.spec.index)
                c["glassbox"] = meta.glassbox()
                if ids_due is not None:     # chat: the prompt's ids on the first chunk
                    c["prompt_token_ids"] = list(ch.spec.prompt)
                first.append(sse(extras(ch, c, ids=False)))
            if job.chat_echo:               # vLLM: the echoed text next, one chunk per choice
                first += [sse(extras(ch, chat_chunk(meta, {"content": job.chat_echo},
                                                    with_usage=with_usage, index=ch.spec.index),
                                     ids=False)) for ch in job.choices]
            yield b"".join(first)
        async for ch, items in merged(job):
            out, reply, spec = [], ch.reply, ch.spec
            idx = spec.index
            for ev in items:
                if isinstance(ev, BaseException):
                    out.append(sse(engine_error(ev, job.prompt_param, job.chat,
                                                ch.spec.request_id).body()))
                    out.append(SSE_DONE)
                    yield b"".join(out)
                    return
                echo_len = len(spec.echo_text or "")
                lps = None if spec.echo_only else job.logprobs_for(
                    [ev.logprobs] if ev.logprobs is not None else [], echo_len + len(reply.text))
                first_event = not reply.token_ids
                reply.add(ev)
                text = "" if spec.echo_only else ev.text
                if ids_due is not None and ev.token_id is not None and not spec.echo_only:
                    ids_due[id(ch)].append(ev.token_id)
                if first_event and (spec.echo_text is not None or job.want_prompt_logprobs):
                    echo, echo_lps = job.echo_part(ch)      # the prompt first, as vLLM streams
                    c = completion_chunk(meta, echo, None, echo_lps, with_usage, idx) \
                        if not job.chat else chat_chunk(meta, {}, with_usage=with_usage,
                                                        index=idx)
                    if job.want_prompt_logprobs:
                        c["choices"][0]["prompt_logprobs"] = job.prompt_logprobs(ch)
                    if first_token[id(ch)]:
                        c["glassbox"] = meta.glassbox()
                        first_token[id(ch)] = False
                    if ids_due is not None and not job.chat and not reply.prompt_sent:
                        c["choices"][0]["prompt_token_ids"] = list(spec.prompt)
                        reply.prompt_sent = True
                    out.append(sse(extras(ch, c, ids=False)))
                parser = parsers.get(id(ch))
                if parser is not None:      # reasoning / tool calls: deltas of their own
                    out += parsed_chunks(job, ch, parser, ev, text, lps,
                                         (lambda d, ch=ch: extras(ch, d))
                                         if ids_due is not None or continuous else None)
                    continue
                if not (ev.finished or text or lps or every_token):
                    continue        # text held back (a possible stop string, a partial char)
                if not (ev.finished or lps or first_token[id(ch)] or ids_due is not None
                        or continuous):
                    out.append(token_chunk[id(ch)](text))   # the common case, fast
                    continue
                reason = stop = None
                if ev.finished:
                    job.finish(ch)
                    reason, stop = ev.finish_reason, reply.stop_reason
                if ev.finished and spec.echo_only:
                    reason = reply.finish_reason
                if job.chat:
                    delta = {"content": text} if text or not ev.finished else {}
                    chunk = chat_chunk(meta, delta, reason, lps, with_usage, idx, stop)
                else:
                    chunk = completion_chunk(meta, text, reason, lps, with_usage, idx, stop)
                if first_token[id(ch)]:
                    chunk["glassbox"] = meta.glassbox()
                    first_token[id(ch)] = False
                out.append(sse(extras(ch, chunk)))
            if out:
                yield b"".join(out)
        if with_usage:
            yield sse(usage_chunk(meta, "chat.completion.chunk" if job.chat
                                  else "text_completion", job.usage()))
        yield SSE_DONE
    finally:
        job.close()


def parsed_chunks(job: Job, ch: Choice, parser: ChatDeltaParser, ev, text: str,
                  lps: dict | None, extras=None) -> list[bytes]:
    """One event of a parsed chat stream: its reasoning / content / tool-call deltas, then (at
    the end) the chunk with the finish reason ("tool_calls" when the reply called a tool).
    `extras`: adds what the request asked for to each chunk built (the token ids due go on
    the first, the rest get none; continuous usage goes on every one)."""
    chunks = _parsed_chunk_dicts(job, ch, parser, ev, text, lps)
    if extras is not None:
        for c in chunks:
            extras(c)
    return [sse(c) for c in chunks]


def _parsed_chunk_dicts(job: Job, ch: Choice, parser: ChatDeltaParser, ev, text: str,
                        lps: dict | None) -> list[dict]:
    meta, usage, idx = job.meta, job.include_usage, ch.spec.index
    n_calls = len(parser.calls)
    deltas = parser.feed(text) + (parser.finish() if ev.finished else [])
    if len(parser.calls) > n_calls and not ev.finished:   # the playground's row shows them
        ch.stream.llm.annotate(ch.spec.request_id, tool_calls_note(parser.calls))
    out = [chat_chunk(meta, d, None, lps if k == 0 else None, usage, idx)
           for k, d in enumerate(deltas)]
    if ev.finished:
        job.finish(ch)
        reason = ch.reply.finish_reason
        if parser.calls and reason == "stop":
            reason = "tool_calls"
        out.append(chat_chunk(meta, {}, reason, None if deltas else lps, usage, idx,
                              ch.reply.stop_reason))
    elif lps and not deltas:
        out.append(chat_chunk(meta, {}, None, lps, usage, idx))
    return out

"""Response bodies and stream chunks of chat and completions, as plain dicts (cheap to encode:
a streamed token costs one small dict and one json.dumps). A request has one choice per
(prompt, n) pair; each body lists them, each stream chunk names its choice's `index`."""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Reply:
    """What one choice produced, accumulated from its TokenEvents."""
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None    # vLLM's: the stop token id or stop string that ended it
    logprobs: list = field(default_factory=list)      # TokenLogprobs per generated token
    token_ids: list = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list | None = None     # TokenLogprobs per prompt token (None first)
    prompt_sent: bool = False       # a stream with return_token_ids sent prompt_token_ids

    def add(self, ev) -> None:
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        self.text += ev.text
        if ev.token_id is not None:
            self.token_ids.append(ev.token_id)
        if ev.logprobs is not None:
            self.logprobs.append(ev.logprobs)
        if ev.finished:
            self.finish_reason = ev.finish_reason
            m = ev.metrics or {}
            self.prompt_tokens = int(m.get("num_prompt_tokens", 0))
            self.completion_tokens = int(m.get("num_output_tokens", 0))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Meta:
    """The fields every body and chunk of one request repeats."""
    id: str
    created: int
    model: str
    watched: bool = False
    request_ids: list = field(default_factory=list)     # engine ids of the choices, in order

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def glassbox(self) -> dict:
        """Where the playground and a client find this request (trace export when watched)."""
        g = {"request_id": self.id, "watched": self.watched}
        if len(self.request_ids) > 1:
            g["request_ids"] = list(self.request_ids)
        if self.watched:
            g["trace_id"] = self.request_ids[0] if self.request_ids else self.id
            g["trace_url"] = f"/v1/glassbox/traces/{g['trace_id']}"
        return g


# ---- chat ----------------------------------------------------------------------------------
def chat_choice(index: int, reply: Reply, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": reply.text},
            "logprobs": logprobs, "finish_reason": reply.finish_reason,
            "stop_reason": reply.stop_reason}


def chat_completion(meta: Meta, choices: list[dict], counts: dict) -> dict:
    return {**meta.head("chat.completion"), "choices": choices, "usage": counts,
            "glassbox": meta.glassbox()}


def chat_chunk(meta: Meta, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, with_usage: bool = False, index: int = 0,
               stop_reason: int | str | None = None) -> dict:
    out = {**meta.head("chat.completion.chunk"),
           "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish_reason, "stop_reason": stop_reason}]}
    if with_usage:          # include_usage: every chunk carries "usage": null but the last
        out["usage"] = None
    return out


# ---- completions ---------------------------------------------------------------------------
def completion_choice(index: int, reply: Reply, logprobs: dict | None, text: str | None = None
                      ) -> dict:
    """`text`: what to show when it is not the reply alone (echo: prompt + reply)."""
    return {"index": index, "text": reply.text if text is None else text, "logprobs": logprobs,
            "finish_reason": reply.finish_reason, "stop_reason": reply.stop_reason}


def completion(meta: Meta, choices: list[dict], counts: dict) -> dict:
    return {**meta.head("text_completion"), "choices": choices, "usage": counts,
            "glassbox": meta.glassbox()}


def completion_chunk(meta: Meta, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None, with_usage: bool = False, index: int = 0,
                     stop_reason: int | str | None = None) -> dict:
    out = {**meta.head("text_completion"),
           "choices": [{"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": finish_reason, "stop_reason": stop_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(meta: Meta, obj: str, counts: dict) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage counts."""
    return {**meta.head(obj), "choices": [], "usage": counts, "glassbox": meta.glassbox()}


class TokenChunks:
    """The common stream chunk (one token's text, no logprobs, not the last) as prebuilt bytes
    around the text: one json.dumps of a short string per token instead of a dict's. Derived
    from the dict builders above, so both paths emit the same bytes."""
    _MARK = "@@glassbox-text@@"

    def __init__(self, meta: Meta, chat: bool, with_usage: bool, index: int = 0):
        from .streaming import sse
        probe = (chat_chunk(meta, {"content": self._MARK}, with_usage=with_usage, index=index)
                 if chat else completion_chunk(meta, self._MARK, with_usage=with_usage,
                                               index=index))
        self.head, self.tail = sse(probe).split(json.dumps(self._MARK).encode())

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail

"""Response bodies and stream chunks of chat and completions, as plain dicts (cheap to encode:
a streamed token costs one small dict and one json.dumps)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Reply:
    """What one request produced, accumulated from its TokenEvents."""
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)      # TokenLogprobs per generated token
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, ev) -> None:
        self.text += ev.text
        if ev.logprobs is not None:
            self.logprobs.append(ev.logprobs)
        if ev.finished:
            self.finish_reason = ev.finish_reason
            m = ev.metrics or {}
            self.prompt_tokens = int(m.get("num_prompt_tokens", 0))
            self.completion_tokens = int(m.get("num_output_tokens", 0))

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class Meta:
    """The fields every body and chunk of one request repeats."""
    id: str
    created: int
    model: str
    watched: bool = False

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def glassbox(self) -> dict:
        """Where the playground and a client find this request (trace export when watched)."""
        g = {"request_id": self.id, "watched": self.watched}
        if self.watched:
            g["trace_id"] = self.id
            g["trace_url"] = f"/v1/glassbox/traces/{self.id}"
        return g


# ---- chat ----------------------------------------------------------------------------------
def chat_completion(meta: Meta, reply: Reply, logprobs: dict | None) -> dict:
    return {**meta.head("chat.completion"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                         "logprobs": logprobs, "finish_reason": reply.finish_reason}],
            "usage": reply.usage(), "glassbox": meta.glassbox()}


def chat_chunk(meta: Meta, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, with_usage: bool = False) -> dict:
    out = {**meta.head("chat.completion.chunk"),
           "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish_reason}]}
    if with_usage:          # include_usage: every chunk carries "usage": null but the last
        out["usage"] = None
    return out


# ---- completions ---------------------------------------------------------------------------
def completion(meta: Meta, reply: Reply, logprobs: dict | None) -> dict:
    return {**meta.head("text_completion"),
            "choices": [{"index": 0, "text": reply.text, "logprobs": logprobs,
                         "finish_reason": reply.finish_reason}],
            "usage": reply.usage(), "glassbox": meta.glassbox()}


def completion_chunk(meta: Meta, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None, with_usage: bool = False) -> dict:
    out = {**meta.head("text_completion"),
           "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                        "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(meta: Meta, obj: str, reply: Reply) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage counts."""
    return {**meta.head(obj), "choices": [], "usage": reply.usage(),
            "glassbox": meta.glassbox()}


class TokenChunks:
    """The common stream chunk (one token's text, no logprobs, not the last) as prebuilt bytes
    around the text: one json.dumps of a short string per token instead of a dict's. Derived
    from the dict builders above, so both paths emit the same bytes."""
    _MARK = "@@glassbox-text@@"

    def __init__(self, meta: Meta, chat: bool, with_usage: bool):
        from .streaming import sse
        probe = (chat_chunk(meta, {"content": self._MARK}, with_usage=with_usage) if chat
                 else completion_chunk(meta, self._MARK, with_usage=with_usage))
        self.head, self.tail = sse(probe).split(json.dumps(self._MARK).encode())

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail

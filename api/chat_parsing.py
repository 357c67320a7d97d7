"""A chat reply's text split the way vLLM's parsers split it: Qwen3's `<think>...</think>` into
`reasoning` (current vLLM's field) and `reasoning_content` (the same text, for older clients),
and Qwen's `<tool_call>{json}</tool_call>` blocks into OpenAI `tool_calls`.
One incremental parser serves both the stream and the whole reply (fed all at once), so the two
can never disagree. Text that could still be the start of a tag is held back, never emitted
twice or in the wrong field."""
from __future__ import annotations

import json
import secrets

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def reasoning_delta(text: str) -> dict:
    """A piece of reasoning under both names vLLM has used: `reasoning` (current clients read
    it) and `reasoning_content` (older ones)."""
    return {"reasoning": text, "reasoning_content": text}


def tool_call(name: str, arguments) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}


def tool_calls_note(calls: list[dict]) -> str:
    """The tool calls parsed so far in a few words, for the request's playground row."""
    return "tool calls: " + ", ".join(
        f'{c["function"]["name"]}({c["function"]["arguments"][:40]})' for c in calls)


def parse_tool_call(body: str) -> dict | None:
    """`{"name": ..., "arguments": {...}}` -> an OpenAI tool call; None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


class ChatDeltaParser:
    """feed(text) -> deltas ({"reasoning", "reasoning_content"}, {"content"},
    {"tool_calls": [...]}) as the reply grows; finish() -> the rest. `reasoning`: split <think>
    blocks (a template that uses them); `tools`: parse <tool_call> blocks (the request sent
    tools, tool_choice not "none")."""

    def __init__(self, reasoning: bool, tools: bool, in_reasoning: bool = False):
        """`in_reasoning`: the prompt already opened <think> (Qwen3-2507 thinking templates):
        the reply starts inside it and only closes it."""
        self.tools = tools
        self.phase = "reasoning" if reasoning and in_reasoning else (
            "start" if reasoning else "content")
        self.buf = ""
        self.calls: list[dict] = []
        self.after_think = False        # drop the newlines Qwen3 puts after </think>

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            before = (self.phase, len(self.buf))
            self._step(out)
            if (self.phase, len(self.buf)) == before:
                return out

    def _step(self, out: list[dict]) -> None:
        b = self.buf
        if self.phase == "start":           # does the reply open with <think>?
            s = b.lstrip()
            if THINK_OPEN.startswith(s) and len(s) < len(THINK_OPEN):
                return                          # too early to say
            if s.startswith(THINK_OPEN):
                self.buf, self.phase = s[len(THINK_OPEN):], "reasoning"
            else:
                self.phase = "content"
            return
        if self.phase == "reasoning":
            i = b.find(THINK_CLOSE)
            if i >= 0:
                if b[:i]:
                    out.append(reasoning_delta(b[:i]))
                self.buf, self.phase, self.after_think = b[i + len(THINK_CLOSE):], "content", True
                return
            keep = _held(b, THINK_CLOSE)
            if len(b) > keep:
                out.append(reasoning_delta(b[:len(b) - keep]))
                self.buf = b[len(b) - keep:]
            return
        if self.phase == "content":
            if self.after_think:
                s = b.lstrip("\n")
                if not s:
                    self.buf = ""
                    return
                self.buf, self.after_think, b = s, False, s
            i = b.find(TOOL_OPEN) if self.tools else -1
            if i >= 0:
                if b[:i] and (not self.calls or b[:i].strip()):
                    out.append({"content": b[:i]})
                self.buf, self.phase = b[i + len(TOOL_OPEN):], "tool"
                return
            keep = _held(b, TOOL_OPEN) if self.tools else 0
            if len(b) > keep and (not self.calls or b[:len(b) - keep].strip()):
                out.append({"content": b[:len(b) - keep]})
                self.buf = b[len(b) - keep:]
            return
        if self.phase == "tool":
            i = b.find(TOOL_CLOSE)
            if i < 0:
                return
            call = parse_tool_call(b[:i].strip())
            if call is None:            # not a tool call after all: the text is content
                out.append({"content": TOOL_OPEN + b[:i + len(TOOL_CLOSE)]})
            else:
                self.calls.append(call)
                out.append({"tool_calls": [{"index": len(self.calls) - 1, **call}]})
            self.buf, self.phase = b[i + len(TOOL_CLOSE):], "content"

    def finish(self) -> list[dict]:
        """The reply ended: whatever is held back goes out as what it is."""
        out = self.feed("")
        b, self.buf = self.buf, ""
        if self.phase in ("reasoning", "start") and b:
            out.append(reasoning_delta(b) if self.phase == "reasoning" else {"content": b})
        elif self.phase == "tool":
            out.append({"content": TOOL_OPEN + b})
        elif b and (self.phase != "content" or not self.calls or b.strip()):
            if not (self.after_think and not b.strip("\n")):
                out.append({"content": b})
        return out


def split_reply(text: str, reasoning: bool, tools: bool, in_reasoning: bool = False
                ) -> tuple[str | None, str | None, list]:
    """(reasoning, content, tool_calls) of a whole reply."""
    p = ChatDeltaParser(reasoning, tools, in_reasoning)
    deltas = p.feed(text) + p.finish()
    r = "".join(d.get("reasoning", "") for d in deltas)
    c = "".join(d.get("content", "") for d in deltas)
    return (r if any("reasoning" in d for d in deltas) else None,
            c if c or not p.calls else None, p.calls)

"""A Responses API reply built from the reply's text as it streams: the chat path's parser
(api.chat_parsing) splits it into reasoning, text and Qwen `<tool_call>` blocks, and this turns
those deltas into output items (reasoning, message, function_call) and the openai SDK's stream
events (response.output_item.added, response.output_text.delta, ...), numbered by
`sequence_number`. The whole reply is the same builder fed the same text, its events unsent,
so a streamed reply and a whole one cannot disagree."""
from __future__ import annotations

import json

from .chat_parsing import ChatDeltaParser
from .responses_items import item_id


def reasoning_delta(d: dict) -> str | None:
    """A parser delta's reasoning text (the parser names it reasoning_content or reasoning)."""
    return d.get("reasoning_content") if "reasoning_content" in d else d.get("reasoning")


class OutputBuilder:
    def __init__(self, parsing, response: dict):
        """`parsing`: the chat path's ReplyParsing (None: plain text); `response`: the response
        object's fields but status, output and usage."""
        p = parsing
        self.parser = ChatDeltaParser(p.reasoning, p.tools, p.in_reasoning) if p is not None \
            else ChatDeltaParser(False, False)
        self.response = response
        self.output: list[dict] = []
        self.current: dict | None = None        # the open reasoning or message item
        self.seq = 0
        self.reasoning_tokens = 0
        self.usage: dict | None = None
        self.status = "in_progress"
        self.logprobs: list[dict] = []      # tokens not yet shown (held back or reasoning)

    # ---- events --------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def snapshot(self) -> dict:
        """The response object now (a copy: later tokens do not change what was sent)."""
        out = {**self.response, "status": self.status,
               "output": json.loads(json.dumps(self.output)), "usage": self.usage}
        if self.status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        elif self.status == "cancelled":
            out["error"] = {"code": "server_error", "message": "the engine aborted the request "
                                                               "before it finished"}
        return out

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    # ---- the reply -----------------------------------------------------------------------------
    def feed(self, text: str, is_token: bool = True, logprobs: list | None = None
             ) -> list[dict]:
        """One engine event's text (and its token's logprobs entry, when asked for) -> the
        stream events it makes. A token's logprobs go with the output text it shows in."""
        self.logprobs += logprobs or ()
        before = self.parser.phase
        events = self._apply(self.parser.feed(text))
        if is_token and "reasoning" in (before, self.parser.phase):
            self.reasoning_tokens += 1
        return events

    def finish(self, finish_reason: str | None, prompt_tokens: int, output_tokens: int
               ) -> list[dict]:
        """The reply ended: the held-back text, the open item closed, the final response."""
        events = self._apply(self.parser.finish())
        # "length": cut at max_output_tokens; "abort": the engine dropped it (shutdown, switch)
        self.status = {"length": "incomplete", "abort": "cancelled"}.get(finish_reason,
                                                                         "completed")
        if not self.output and self.current is None:    # an empty reply: one empty message
            events += self._open("message")
        if self.logprobs and self.current is not None and self.current["type"] == "message":
            events += self._text("message", "")     # the last tokens' (EOS: no text)
        events += self._close("completed" if self.status == "completed" else "incomplete")
        self.usage = {"input_tokens": prompt_tokens,
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": output_tokens,
                      "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens,
                                                                        output_tokens)},
                      "total_tokens": prompt_tokens + output_tokens}
        final = {"incomplete": "response.incomplete", "cancelled": "response.failed"}
        events.append(self.event(final.get(self.status, "response.completed"),
                                 response=self.snapshot()))
        return events

    def body(self) -> dict:
        return self.snapshot()

    def reply_message(self) -> dict:
        """The reply as a chat assistant message (a later turn's history)."""
        msg = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "message":
                msg["content"] += "".join(c["text"] for c in item["content"])
            elif item["type"] == "reasoning":
                msg["reasoning_content"] = "".join(c["text"] for c in item["content"])
            elif item["type"] == "function_call":
                msg.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return msg

    def _apply(self, deltas: list[dict]) -> list[dict]:
        events: list[dict] = []
        for d in deltas:
            r = reasoning_delta(d)
            if r:
                events += self._text("reasoning", r)
            if d.get("content"):
                events += self._text("message", d["content"])
            for call in d.get("tool_calls") or ():
                events += self._close("completed") + self._call(call)
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.current is None or self.current["type"] != kind:
            events += self._close("completed") + self._open(kind)
        item, at = self.current, len(self.output) - 1
        item["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else \
            "response.reasoning_text.delta"
        lps, self.logprobs = self.logprobs, []     # a reasoning token's are not shown
        extra = {}
        if kind == "message":
            item["content"][0]["logprobs"] += lps
            extra = {"logprobs": lps}
        events.append(self.event(delta, item_id=item["id"], output_index=at, content_index=0,
                                 delta=text, **extra))
        return events

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": item_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [],
                    "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        at = len(self.output) - 1
        events = [self.event("response.output_item.added", output_index=at,
                             item=json.loads(json.dumps(item))),
                  self.event("response.content_part.added", item_id=item["id"], output_index=at,
                             content_index=0, part=json.loads(json.dumps(part)))]
        item["content"].append(part)
        self.current = item
        return events

    def _close(self, status: str) -> list[dict]:
        item, self.current = self.current, None
        if item is None:
            return []
        at = self.output.index(item)
        part = item["content"][0]
        item["status"] = status
        done = "response.output_text.done" if item["type"] == "message" else \
            "response.reasoning_text.done"
        extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
        return [self.event(done, item_id=item["id"], output_index=at, content_index=0,
                           text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=at,
                           content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=at,
                           item=json.loads(json.dumps(item)))]

    def _call(self, call: dict) -> list[dict]:
        fn = call["function"]
        item = {"id": item_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}
        self.output.append(item)
        at = len(self.output) - 1
        return [self.event("response.output_item.added", output_index=at,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=at, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=at, name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=at, item=dict(item))]

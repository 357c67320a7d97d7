"""A Responses API request (`POST /v1/responses`) as the chat request the chat path serves:
`instructions` + a stored conversation (`previous_response_id`) + `input` (a string, or items:
messages with input_text / output_text parts, function_call and function_call_output, reasoning)
become chat messages; flat function tools, `tool_choice`, `text.format` and
`max_output_tokens` become their chat fields. Everything else the chat path checks, once.

The vLLM sampling fields chat accepts (top_k, min_p, seed, stop, repetition_penalty, ...) and
Glassbox's own (`glassbox`, `interventions`) pass through under their chat names."""
from __future__ import annotations

import json
import secrets
from typing import Any

from pydantic import Field

from .errors import APIError, bad_request
from .limits import parse_body
from .protocol import ChatCompletionRequest, Lenient


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None      # effort / summary: the model thinks or not
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    conversation: Any = None
    stream_options: dict[str, Any] | None = None    # include_obfuscation: nothing to obfuscate


LOGPROBS = "message.output_text.logprobs"      # `include`: the output text's token logprobs
# chat fields that the Responses API names otherwise: sent here under their chat name, a 400
# that says which field to use
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
               "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "n": None, "logprobs": None, "echo": None,
               "continue_final_message": None, "add_generation_prompt": None}
# request fields of the chat path a reply needs nothing else for
_PASSED = ("model", "stream", "temperature", "top_p", "user", "metadata", "parallel_tool_calls")


def response_id_param(param: str | None) -> str | None:
    """The Responses field behind a chat field the chat path named in an error."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    return {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format"}.get(param, param)


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    return parse_body(raw, ResponsesRequest)


def checked(req: ResponsesRequest) -> None:
    """400s for what the Responses API has and Glassbox does not do, each naming its field."""
    if req.input is None:
        raise bad_request("'input' is a required property: a string or a list of items", "input")
    if isinstance(req.input, list) and not req.input and req.previous_response_id is None:
        raise bad_request("input is empty: give a string or at least one item", "input")
    if req.background:
        raise bad_request("background responses are not supported: the reply comes in this "
                          "request (stream it with stream: true)", "background")
    if req.conversation is not None:
        raise bad_request("conversation objects are not supported: continue a conversation "
                          "with previous_response_id", "conversation")
    if req.truncation not in (None, "disabled", "auto"):
        raise bad_request(f"truncation must be 'disabled' or 'auto', got {req.truncation!r}",
                          "truncation")
    for name, instead in _CHAT_NAMES.items():
        if name in (req.model_extra or {}):
            raise bad_request(f"{name} is a chat completions field; the Responses API "
                              + (f"uses {instead}" if instead else "has no such field"), name)


def _text_of(content, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content (a string or a list of text parts) as one text; parts joined by
    newlines, as vLLM joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: content part of type {kind!r} is not supported: "
                              f"Glassbox serves text-only models; send {' or '.join(kinds)} "
                              "parts with their text", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items -> chat messages (the chat template's {role, content, tool_calls, ...})."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning = None            # a reasoning item goes on the assistant message after it

    def assistant() -> dict:
        """The assistant message the next function call or reasoning belongs to."""
        nonlocal reasoning
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            out[-1]["reasoning_content"], reasoning = reasoning, None
        return out[-1]
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be 'user', 'system', 'developer' or "
                                  f"'assistant', got {role!r}", f"{where}.role")
            parts = ("output_text",) if role == "assistant" else ("input_text",)
            text = _text_of(item.get("content"), f"{where}.content", parts + ("text",))
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad_request(f"{where}: a function_call item needs 'name' and 'arguments' "
                                  "(a JSON string)", where)
            call_id = item.get("call_id") or item.get("id") or item_id("call")
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.call_id is required: the call_id of the "
                                  "function_call it answers", f"{where}.call_id")
            text = _text_of(output, f"{where}.output", ("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text_of(parts, f"{where}.content",
                                 ("reasoning_text", "summary_text"))
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported: give message, "
                              "function_call, function_call_output or reasoning items",
                              f"{where}.type")
    return out


def listed_items(items: str | list[dict]) -> list[dict]:
    """The input as the items GET /v1/responses/{id}/input_items lists: each with an id and a
    type, a string as one user message."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": items}]}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}.get(kind, "item")
        one = {"id": item.get("id") or item_id(prefix), **item, "type": kind}
        if kind == "message" and isinstance(one.get("content"), str):
            part = "output_text" if one.get("role") == "assistant" else "input_text"
            one["content"] = [{"type": part, "text": one["content"]}]
        out.append(one)
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> chat's {type: function, function: {...}}."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"tools[{i}].type {kind!r} is not supported: only function tools "
                              "(the model calls them, your code runs them)", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}].name is required", f"tools[{i}].name")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object",
                                                                        "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice):
    """'auto' / 'none' / 'required' as they are; {type: function, name} -> chat's form."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'name': ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict | None) -> dict | None:
    """`text.format` -> chat's response_format (json_schema keeps its name, schema, strict)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type must be 'text', 'json_object' or 'json_schema'",
                          "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format needs a 'schema' (a JSON schema object) with type "
                          "json_schema", "text.format.schema")
    spec = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
    if fmt.get("strict") is not None:
        spec["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": spec}


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest,
                                                                       list[dict]]:
    """(the chat request to serve, the conversation to store: history + input, no
    instructions). `history`: the previous response's conversation (its reply included)."""
    checked(req)
    conversation = history + input_messages(req.input)
    if not conversation:
        raise bad_request("input is empty: give a string or at least one item", "input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {k: getattr(req, k) for k in _PASSED if getattr(req, k) is not None}
    # vLLM's and Glassbox's extra fields, under the chat path's names (unknown ones are
    # logged as ignored by the route, as on chat)
    body.update(req.model_extra or {})
    body.update(messages=system + conversation, max_tokens=req.max_output_tokens,
                tools=chat_tools(req.tools),
                tool_choice=chat_tool_choice(req.tool_choice) if req.tools else None,
                response_format=response_format(req.text))
    effort = (req.reasoning or {}).get("effort")
    kwargs = body.get("chat_template_kwargs")
    if effort == "none" and (kwargs is None or isinstance(kwargs, dict)):
        # Qwen3's hybrid templates: no thinking (a template without the variable ignores it);
        # the client's own enable_thinking wins
        body["chat_template_kwargs"] = {"enable_thinking": False, **(kwargs or {})}
    if req.top_logprobs is not None or LOGPROBS in (req.include or ()):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    # as JSON, strictly, as the chat route parses its body: a passed-through field is held to
    # the same types ("ignore_eos": "true" is a 400 here too)
    raw = json.dumps(body).encode()     # escaped: a lone surrogate reads back as it came
    try:
        return parse_body(raw, ChatCompletionRequest), conversation
    except APIError as e:
        e.param = response_id_param(e.param)
        raise

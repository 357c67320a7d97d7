"""Structured output requests -> the engine's grammar (SamplingParams.guided, llguidance):
`response_format` json_object / json_schema (OpenAI), vLLM's `structured_outputs` (json / regex /
choice / json_object) and the guided_json / guided_regex / guided_choice it replaced, and
tool_choice "required" or a named function (the reply is forced into Qwen's
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` form, arguments matching the tool's
parameters schema). JSON schemas are closed as vLLM's default backend closes them
(`closed_schema`)."""
from __future__ import annotations

import json
import re

from .errors import bad_request
from .protocol import ChatCompletionRequest, SamplingRequest

_COMPACT = {"whitespace_flexible": False}


def _schema(s) -> dict:
    s = s if isinstance(s, dict) else {}
    return {**s, "x-guidance": {**_COMPACT, **s.get("x-guidance", {})}}


# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas
# (`const`, `enum`, `default`, `examples` hold data, never walked)
_SUB_SCHEMA = ("items", "additionalProperties", "additionalItems", "contains", "not", "if",
               "then", "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _is_object(node: dict) -> bool:
    t = node.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or (
        t is None and isinstance(node.get("properties"), dict))


def closed_schema(schema):
    """A copy of `schema` whose objects that say nothing of `additionalProperties` get
    `false`, at every depth: vLLM's default backend (xgrammar, strict mode) closes them, and an
    open object lets a small model add keys until it runs out of tokens (LangChain's @tool and
    LiteLLM send tool schemas without the key). A schema that sets it keeps its choice."""
    if not isinstance(schema, dict):
        return schema
    schema = json.loads(json.dumps(schema))     # a copy (the request's own is left as sent)
    stack = [schema]
    while stack:                                # iterative: a schema may nest deeply
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if _is_object(node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for k in _SUB_SCHEMA:
            if isinstance(node.get(k), dict):
                stack.append(node[k])
        for k in _SUB_LIST:
            if isinstance(node.get(k), list):
                stack.extend(node[k])
        for k in _SUB_MAP:
            if isinstance(node.get(k), dict):
                stack.extend(node[k].values())
    return schema


def _tool_schema(tool: dict) -> dict:
    fn = tool.get("function", {}) if isinstance(tool, dict) else {}
    params = closed_schema(fn.get("parameters") or {"type": "object"})
    return {"type": "object", "properties": {"name": {"const": fn.get("name")},
                                             "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tool_grammar(tools: list[dict], many: bool) -> str:
    from engine.guided import lark_grammar
    call = _schema({"anyOf": [_tool_schema(t) for t in tools]} if len(tools) > 1
                   else _tool_schema(tools[0]))
    start = 'start: tc ("\\n" tc)*' if many else "start: tc"
    lark = f'{start}\ntc: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(call)}'
    return lark_grammar(lark)


# structured_outputs' members (attribute -> its name on the wire); each is built as the guided_*
# field it replaced (guided_json / guided_regex / guided_choice)
_STRUCTURED = {"json_schema": "json", "regex": "regex", "choice": "choice"}
# refused: what Glassbox cannot honour, and what to send instead
_REFUSED = {
    "grammar": "a GBNF grammar (xgrammar's syntax) is not supported; give json, regex or choice",
    "structural_tag": "structural tags are not supported; give json, regex or choice",
    "whitespace_pattern": "a custom whitespace pattern is not supported (JSON is generated "
                          "compact); leave it out",
}


def check_structured_fields(req: SamplingRequest) -> None:
    """400 for the structured-output fields vLLM has and Glassbox does not honour: a request
    that asks for a grammar must never come back unconstrained."""
    for name, old in (("grammar", "guided_grammar"), ("structural_tag", "structural_tag"),
                      ("whitespace_pattern", "guided_whitespace_pattern")):
        if getattr(req, old) is not None:
            raise bad_request(f"{old}: {_REFUSED[name]}", old)
    so = req.structured_outputs
    if so is None:
        return
    for name in ("grammar", "structural_tag", "whitespace_pattern"):
        if getattr(so, name) is not None:
            raise bad_request(f"structured_outputs.{name}: {_REFUSED[name]}",
                              f"structured_outputs.{name}")
    if so.disable_additional_properties:
        raise bad_request("structured_outputs.disable_additional_properties is not supported: "
                          "set \"additionalProperties\": false in the schema itself",
                          "structured_outputs.disable_additional_properties")


def grammar_of(req: SamplingRequest) -> tuple[str | None, str | None]:
    """(the request's grammar for SamplingParams.guided, the field that asked for it), or
    (None, None). Built here, compiled once by the engine's processor (whose refusal the route
    names by this field)."""
    chat = isinstance(req, ChatCompletionRequest)
    check_structured_fields(req)
    asked = []
    extra = {"guided_json": req.guided_json, "guided_regex": req.guided_regex,
             "guided_choice": req.guided_choice}
    if chat and req.response_format and req.response_format.get("type", "text") != "text":
        asked.append("response_format")
    for name in ("guided_json", "guided_regex", "guided_choice"):
        if extra.get(name) is not None:
            asked.append(name)
    so = req.structured_outputs
    if so is not None:
        for member, wire in _STRUCTURED.items():
            if getattr(so, member) is not None:
                name = f"structured_outputs.{wire}"
                extra[name] = getattr(so, member)
                asked.append(name)
        if so.json_object:
            asked.append("structured_outputs.json_object")
    forced_tool = chat and req.tools and (req.tool_choice == "required"
                                          or isinstance(req.tool_choice, dict))
    if forced_tool:
        asked.append("tool_choice")
    if not asked:
        return None, None
    if len(asked) > 1:
        raise bad_request(f"give one kind of structured output, not {asked}", asked[1])
    kind = asked[0]
    return _build(req, kind, extra), kind


def _build(req, kind: str, extra: dict) -> str:
    try:
        from engine.guided import json_schema_grammar, regex_grammar
        if kind == "response_format":
            fmt = req.response_format
            if fmt["type"] == "json_object":
                return json_schema_grammar(_schema({"type": "object"}))
            if fmt["type"] == "json_schema":
                spec = fmt.get("json_schema") or {}
                if "schema" not in spec:
                    raise bad_request("response_format.json_schema needs a 'schema'",
                                      "response_format")
                return json_schema_grammar(_schema(closed_schema(spec["schema"])))
            raise bad_request(f"response_format type {fmt['type']!r} is not one of 'text', "
                              "'json_object', 'json_schema'", "response_format")
        if kind == "structured_outputs.json_object":
            return json_schema_grammar(_schema({"type": "object"}))
        if kind in ("guided_json", "structured_outputs.json"):
            g = extra[kind]
            return json_schema_grammar(_schema(closed_schema(json.loads(g) if isinstance(g, str)
                                                             else g)))
        if kind in ("guided_regex", "structured_outputs.regex"):
            return regex_grammar(str(extra[kind]))
        if kind in ("guided_choice", "structured_outputs.choice"):
            choices = [str(c) for c in extra[kind]]
            if not choices:
                raise bad_request(f"{kind} is empty: give at least one choice", kind)
            return regex_grammar("(" + "|".join(re.escape(c) for c in choices) + ")")
        # tool_choice
        tools = req.tools
        if isinstance(req.tool_choice, dict):
            name = (req.tool_choice.get("function") or {}).get("name")
            tools = [t for t in req.tools if (t.get("function") or {}).get("name") == name]
            if not tools:
                raise bad_request(f"tool_choice names the function {name!r}, which is not in "
                                  "tools", "tool_choice")
        return _tool_grammar(tools, many=req.parallel_tool_calls is not False
                             and not isinstance(req.tool_choice, dict))
    except (ValueError, TypeError, KeyError) as e:
        raise bad_request(f"{kind} cannot be used for guided decoding: {e}", kind) from None
    except RecursionError:
        raise bad_request(f"{kind} is nested too deeply to be used for guided decoding",
                          kind) from None

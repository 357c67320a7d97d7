"""Structured output requests -> the engine's grammar (SamplingParams.guided, llguidance):
`response_format` json_object / json_schema (OpenAI) / structural_tag (vLLM), vLLM's
`structured_outputs` (json / regex / choice / grammar / structural_tag / json_object) and the
guided_* fields it replaced, and
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
# field it replaced (guided_json / guided_regex / guided_choice / guided_grammar / structural_tag)
_STRUCTURED = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "structural_tag": "structural_tag"}
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag")
# a grammar's text is converted (GBNF -> Lark) in Python before llguidance's limits apply
MAX_GRAMMAR_CHARS = 100_000


def check_structured_fields(req: SamplingRequest) -> None:
    """400 for the structured-output fields vLLM has and Glassbox does not honour: a request
    that asks for a grammar must never come back unconstrained."""
    why = ("a custom whitespace pattern is not supported (JSON is generated compact); leave "
           "it out")
    if req.guided_whitespace_pattern is not None:
        raise bad_request(f"guided_whitespace_pattern: {why}", "guided_whitespace_pattern")
    so = req.structured_outputs
    if so is not None and so.whitespace_pattern is not None:
        raise bad_request(f"structured_outputs.whitespace_pattern: {why}",
                          "structured_outputs.whitespace_pattern")
    # (structured_outputs.disable_additional_properties: closes open objects, which every
    # schema here is already (closed_schema): served, no effect)


def grammar_text(text, kind: str) -> str:
    """llguidance's grammar for a `grammar` field: Lark (llguidance's dialect, `start:`) or
    GBNF / EBNF (llama.cpp's and xgrammar's, `root ::=`), told apart by their syntax as
    vLLM's guidance backend does."""
    from engine.guided import grammar_from_text
    if not isinstance(text, str) or not text.strip():
        raise bad_request(f"{kind} must be a non-empty grammar (Lark or GBNF)", kind)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{kind} is {len(text):,} characters long; at most "
                          f"{MAX_GRAMMAR_CHARS:,} are allowed", kind)
    return grammar_from_text(text)


def structural_tag_grammar(spec, kind: str) -> str:
    """vLLM's structural tag (`{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`, as a JSON string or an object): the text is free until a
    trigger; from there a structure's begin, JSON matching its schema (closed, as every schema
    here), and its end."""
    from engine.guided import struct_tag_grammar
    if isinstance(spec, str):
        if len(spec) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"{kind} is {len(spec):,} characters long; at most "
                              f"{MAX_GRAMMAR_CHARS:,} are allowed", kind)
        spec = json.loads(spec)
    form = ('give {"type": "structural_tag", "structures": [{"begin": ..., "schema": {...}, '
            '"end": ...}], "triggers": [...]}')
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or \
            not spec["structures"] or not isinstance(spec.get("triggers"), list) or \
            not all(isinstance(t, str) and t for t in spec["triggers"]):
        raise bad_request(f"{kind} is not a structural tag with structures and triggers: "
                          f"{form} (xgrammar's newer `format` form is not supported)", kind)
    tags = []
    for i, st in enumerate(spec["structures"]):
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or \
                not isinstance(st.get("end"), str) or "schema" not in st:
            raise bad_request(f"{kind}: structures[{i}] needs begin, schema and end: {form}",
                              kind)
        trigger = next((t for t in spec["triggers"] if st["begin"].startswith(t)), None)
        if trigger is None:
            raise bad_request(f"{kind}: structures[{i}]'s begin {st['begin']!r:.60} starts "
                              f"with none of the triggers", kind)
        tags.append((trigger, st["begin"], closed_schema(st["schema"]), st["end"]))
    return struct_tag_grammar(tags)


def grammar_of(req: SamplingRequest) -> tuple[str | None, str | None]:
    """(the request's grammar for SamplingParams.guided, the field that asked for it), or
    (None, None). Built here, compiled once by the engine's processor (whose refusal the route
    names by this field)."""
    chat = isinstance(req, ChatCompletionRequest)
    check_structured_fields(req)
    asked = []
    extra = {name: getattr(req, name) for name in _GUIDED}
    if chat and req.response_format and req.response_format.get("type", "text") != "text":
        asked.append("response_format")
    for name in _GUIDED:
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
            if fmt["type"] == "structural_tag":
                return structural_tag_grammar(fmt, kind)
            raise bad_request(f"response_format type {fmt['type']!r} is not one of 'text', "
                              "'json_object', 'json_schema', 'structural_tag'",
                              "response_format")
        if kind == "structured_outputs.json_object":
            return json_schema_grammar(_schema({"type": "object"}))
        if kind in ("guided_json", "structured_outputs.json"):
            g = extra[kind]
            return json_schema_grammar(_schema(closed_schema(json.loads(g) if isinstance(g, str)
                                                             else g)))
        if kind in ("guided_regex", "structured_outputs.regex"):
            return regex_grammar(str(extra[kind]))
        if kind in ("guided_grammar", "structured_outputs.grammar"):
            return grammar_text(extra[kind], kind)
        if kind in ("structural_tag", "structured_outputs.structural_tag"):
            return structural_tag_grammar(extra[kind], kind)
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

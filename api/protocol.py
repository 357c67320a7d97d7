"""Request bodies of the OpenAI-compatible routes, as pydantic models.

Field names are OpenAI's, plus vLLM's extensions (sampling: `top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `stop_token_ids`; `structured_outputs` and the guided_* fields; `truncate_prompt_tokens`,
`return_token_ids`, `cache_salt`, `prompt_logprobs`, ...) and Glassbox's own `glassbox` object.
Lenient where vLLM is: an unknown field is ignored with a logged warning (`ignored_fields` lists
them), an explicit `null` means the field's default, and `model` may be left out. vLLM's fields
that Glassbox does not honour are declared here so that they are never "unknown": `api.sampling`
and `api.structured` serve them at their neutral value and refuse any other with a 400 that says
why.
"""
from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger("glassbox.api")


class Lenient(BaseModel):
    """vLLM's leniency: unknown fields are kept aside (and logged by the route), and `null` for a
    field whose default is not null is the default (clients send `"n": null`, `"stream": null`)."""
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None)}
        return data

    def ignored_fields(self) -> list[str]:
        """Unknown fields of this object and its nested ones (dotted), in the order sent."""
        out = list(self.model_extra or {})
        for name in type(self).model_fields:
            v = getattr(self, name, None)
            if isinstance(v, Lenient):
                out += [f"{name}.{k}" for k in v.ignored_fields()]
        return out


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's: with include_usage, usage on every chunk


class ProbeOptions(BaseModel):
    """Which probes a watched request runs (engine.ProbeSpec's fields; all on by default)."""
    model_config = ConfigDict(extra="forbid")
    norms: bool = True
    logit_lens: bool = True
    attention: bool = True
    routing: bool = True
    layers: list[int] | None = None


class GlassboxOptions(BaseModel):
    """`"glassbox": {"watch": true}` records a trace of the request for the Layers tab."""
    model_config = ConfigDict(extra="forbid")
    watch: bool | ProbeOptions = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")     # name, tool_call_id, ...: harmless
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class StructuredOutputs(Lenient):
    """vLLM's `structured_outputs` object (v0.12 removed the guided_* fields in its favour):
    one of json / regex / choice / grammar / structural_tag / json_object; whitespace_pattern
    is refused (api.structured says why)."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")   # "json" shadows BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False    # ours is compact already: neutral either way
    disable_additional_properties: bool = False     # closes objects: ours are closed already
    disable_fallback: bool = False          # one backend, no fallback: neutral


class SamplingRequest(Lenient):
    """The fields chat and completions share."""
    model: str | None = None            # vLLM: optional, the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)        # 0: only with echo (the prompt alone)
    temperature: float | None = Field(None, ge=0)       # None: OpenAI's default, 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)              # vLLM: -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    # understood, refused unless neutral (api.sampling says why)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # understood, no effect on the output
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    glassbox: GlassboxOptions | None = None
    # Glassbox: per-request edits of the forward pass (api/interventions.py checks them)
    interventions: list[dict[str, Any]] | None = None
    request_id: str | None = None       # vLLM's: the request's id (X-Request-Id wins)
    return_token_ids: bool | None = None    # vLLM's: prompt_token_ids and token_ids in the reply
    cache_salt: str | None = None       # vLLM's: only requests with the same salt share cached blocks
    prompt_logprobs: int | None = Field(None, ge=0, le=20)   # vLLM's: the prompt's logprobs
    # vLLM's guided decoding fields (api.structured): the current object, and the fields
    # before v0.12 that it replaced
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None               # Lark or GBNF
    guided_whitespace_pattern: str | None = None    # refused
    structural_tag: Any = None                      # vLLM's structures / triggers form
    guided_decoding_backend: str | None = None      # one backend (llguidance): no effect
    # vLLM's other sampling / output fields (engine.SamplingParams has their meaning)
    truncate_prompt_tokens: int | None = None       # keep the prompt's last k tokens (-1: max_model_len)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False    # logprob tokens named `token_id:N`
    # refused unless they hold their neutral value (api.sampling: never silently ignored)
    use_beam_search: bool = False
    length_penalty: float | None = None
    logits_processors: list[Any] | None = None
    priority: int = 0


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's chat extensions: the template's own variables (enable_thinking, ...), and an
    # assistant prefill (the last assistant message continued, not closed)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False              # vLLM's chat echo: the last message's text first
    chat_template: str | None = None    # vLLM's per-request template: refused (the checkpoint's)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    prompt_embeds: Any = None           # vLLM's embeddings instead of ids: refused

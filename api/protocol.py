"""Request bodies of the OpenAI-compatible routes, as pydantic models.

Field names are OpenAI's, plus vLLM's sampling extensions (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `stop_token_ids`) and Glassbox's own `glassbox` object. Lenient where vLLM is:
an unknown field is ignored with a logged warning (`ignored_fields` lists them), an explicit
`null` means the field's default, and `model` may be left out. Fields that are understood but
not supported are refused by `api.sampling` with a message that says so.
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
    prompt_logprobs: int | None = Field(None, ge=0, le=20)   # vLLM's: the prompt's logprobs
    # vLLM's guided decoding fields (api.structured)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


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


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

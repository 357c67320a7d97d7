"""OpenAI request fields -> the engine's prompt, SamplingParams and ProbeSpec.

Defaults: temperature 1.0 (OpenAI's). max_tokens: 16 for /v1/completions (OpenAI's legacy
default, as vLLM), and for chat "until the model's limit": the engine stops at
`max_model_len` with finish_reason "length", which is vLLM's max_model_len - prompt_len.
Anything understood but not supported is refused with a 400 naming it, never ignored.
"""
from __future__ import annotations

from engine import ProbeSpec, SamplingParams

from .errors import bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens",
                    "stop", "stop_token_ids", "logprobs")


def refuse_unsupported(req: SamplingRequest) -> None:
    if req.n != 1:
        raise bad_request(f"n={req.n}: Glassbox returns one choice per request, so n must be 1; "
                          f"send {req.n} requests instead (they batch together)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported by Glassbox; leave it unset or 0", name)
    if req.repetition_penalty not in (None, 1, 1.0):
        raise bad_request("repetition_penalty is not supported by Glassbox; leave it unset or 1",
                          "repetition_penalty")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by Glassbox", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        if req.tools:
            raise bad_request("tools are not supported by Glassbox (no tool-call parsing)",
                              "tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported by Glassbox", "tool_choice")
        fmt = (req.response_format or {}).get("type", "text")
        if fmt != "text":
            raise bad_request(f"response_format {fmt!r} is not supported by Glassbox (no "
                              "constrained decoding); use 'text'", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    else:
        if req.echo:
            raise bad_request("echo is not supported by Glassbox", "echo")
        if req.suffix:
            raise bad_request("suffix is not supported by Glassbox", "suffix")
        if req.best_of not in (None, 1):
            raise bad_request("best_of must be 1: Glassbox returns one choice per request",
                              "best_of")


def max_tokens_of(req: SamplingRequest, max_model_len: int) -> tuple[int, str]:
    """(max new tokens, the parameter that set it)."""
    if isinstance(req, ChatCompletionRequest):
        a, b = req.max_completion_tokens, req.max_tokens
        if a is not None and b is not None and a != b:
            raise bad_request(f"max_completion_tokens={a} and max_tokens={b} disagree; set one",
                              "max_completion_tokens")
        if a is not None:
            return a, "max_completion_tokens"
        return (b, "max_tokens") if b is not None else (max_model_len, "max_tokens")
    if req.max_tokens is not None:
        return req.max_tokens, "max_tokens"
    return COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens"


def logprobs_of(req: SamplingRequest) -> tuple[bool, int]:
    """(logprobs wanted, how many top alternatives to show per token)."""
    if isinstance(req, ChatCompletionRequest):
        return req.logprobs, (req.top_logprobs or 0) if req.logprobs else 0
    return req.logprobs is not None, req.logprobs or 0


def sampling_params(req: SamplingRequest, max_model_len: int) -> SamplingParams:
    """SamplingParams for the request; the engine's own checks become 400s naming the field."""
    refuse_unsupported(req)
    max_tokens, max_param = max_tokens_of(req, max_model_len)
    wanted, top_n = logprobs_of(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    kw = dict(temperature=1.0 if req.temperature is None else req.temperature,
              top_k=max(0, req.top_k or 0), top_p=1.0 if req.top_p is None else req.top_p,
              min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens,
              min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=tuple(stop),
              stop_token_ids=tuple(req.stop_token_ids or ()),
              # the engine returns the sampled token's logprob with its top-k: ask for >= 1
              logprobs=max(1, top_n) if wanted else 0)
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
        # the longest name first: "stop_token_ids ..." starts with "stop" too
        field = next((f for f in sorted(_SAMPLING_FIELDS, key=len, reverse=True)
                      if msg.startswith(f)), None)
        param = {"max_tokens": max_param, "logprobs": "top_logprobs"
                 if isinstance(req, ChatCompletionRequest) else "logprobs"}.get(field, field)
        raise bad_request(msg, param) from None


def probe_spec(req: SamplingRequest) -> ProbeSpec | None:
    """`"glassbox": {"watch": true}` (or a dict of probe switches) -> ProbeSpec, else None."""
    watch = req.glassbox.watch if req.glassbox is not None else False
    if watch is False:
        return None
    if watch is True:
        return ProbeSpec()
    try:
        return ProbeSpec(norms=watch.norms, logit_lens=watch.logit_lens,
                         attention=watch.attention, routing=watch.routing,
                         layers=None if watch.layers is None else tuple(watch.layers))
    except ValueError as e:
        raise bad_request(str(e), "glassbox.watch") from None


# ---- prompts ----------------------------------------------------------------------------------
def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages -> the plain {role, content} dicts the chat template takes."""
    out = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content part of type {part.type!r} is not supported: "
                                      "Glassbox serves text-only models; send text parts",
                                      f"messages[{i}].content[{j}]")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """One prompt: a string or a list of token ids (a batch of prompts is refused)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt holds {len(p)} prompts; Glassbox takes one prompt per "
                              "request: send one request each (they batch together)", "prompt")
        p = p[0]
    if not p:
        raise bad_request("prompt is empty: give at least one character or token id", "prompt")
    return p

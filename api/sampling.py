"""OpenAI request fields -> the engine's prompts, SamplingParams and ProbeSpec.

Defaults, as vLLM's: a field the request leaves out takes the model card's value
(generation_config.json, api.generation_config), else OpenAI's (temperature 1.0). max_tokens:
16 for /v1/completions (OpenAI's legacy default), and for chat "the rest of the context"
(max_model_len - prompt tokens); either is capped to the room the prompt leaves. A max_tokens
given explicitly that does not fit beside the prompt is a 400 naming the limit (vLLM's check).
Anything understood but not supported is refused with a 400 naming it, never ignored.
"""
from __future__ import annotations

from engine import InvalidArgumentError, ProbeSpec, SamplingParams

from .errors import bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# SamplingParams fields a request sets under the same name
_SAME_NAME = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "min_tokens", "stop",
                        "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                        "repetition_penalty", "logit_bias", "prompt_logprobs",
                        "allowed_token_ids", "bad_words", "include_stop_str_in_output",
                        "skip_special_tokens", "spaces_between_special_tokens"})


def request_param(engine_param: str | None, chat: bool,
                  max_param: str = "max_tokens", guided: str | None = None) -> str | None:
    """The request field that an engine argument (InvalidArgumentError.param) came from; None
    when the request has no such field. `max_param`: the field that set max_tokens; `guided`:
    the field that asked for structured output."""
    if engine_param is None:
        return None
    if engine_param in _SAME_NAME or engine_param in ("cache_salt", "priority") or \
            engine_param.startswith("interventions"):
        return engine_param
    if engine_param.startswith("messages[") or engine_param == "tools":
        return engine_param if chat else "prompt"
    if engine_param == "max_tokens":
        return max_param
    if engine_param == "logprobs":
        return "top_logprobs" if chat else "logprobs"
    if engine_param == "prompt":
        return "messages" if chat else "prompt"
    if engine_param == "guided":
        return guided or "response_format"
    if engine_param == "watch" or engine_param.startswith("watch."):
        return "glassbox.watch"
    return None


# vLLM too refuses a request's own template unless its server trusts them
CHAT_TEMPLATE_REFUSED = ("a chat_template in the request is not accepted: the server renders "
                         "the checkpoint's own template (use chat_template_kwargs for its "
                         "variables)")


# vLLM request fields Glassbox does not honour: (field, its neutral values, why / what instead).
# A request holding a neutral value is served; any other value is a 400 naming the field,
# never a reply that silently ignored it.
_NEUTRAL_ONLY = (
    ("use_beam_search", (False,), "there is no beam search; sample n choices instead"),
    ("length_penalty", (None, 1.0), "it applies to beam search, which Glassbox does "
                                    "not have"),
    ("logits_processors", (None, []), "there are no custom logits processors (arbitrary "
                                      "code named by a request is never loaded)"),
)


def refuse_unsupported(req: SamplingRequest) -> None:
    for name, neutral, why in _NEUTRAL_ONLY:
        v = getattr(req, name)
        if not any(v == n and type(v) is type(n) or v is n for n in neutral):
            raise bad_request(f"{name}={v!r} is not supported: {why}", name)
    t = req.truncate_prompt_tokens
    if t is not None and t != -1 and t < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 (the model's max_model_len) or at "
                          f"least 1, got {t}", "truncate_prompt_tokens")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        if req.tool_choice not in (None, "none", "auto", "required") and \
                not isinstance(req.tool_choice, dict):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                              f"{req.tool_choice!r}", "tool_choice")
        if req.tool_choice not in (None, "none", "auto") and not req.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message continues the last assistant message: "
                              "set add_generation_prompt to false with it",
                              "continue_final_message")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the "
                              "assistant's (the text to continue)", "continue_final_message")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.chat_template is not None:
            raise bad_request(CHAT_TEMPLATE_REFUSED, "chat_template")
    else:
        if req.suffix:
            raise bad_request("suffix is not supported by Glassbox", "suffix")
        if req.prompt_embeds is not None:
            raise bad_request("prompt_embeds is not supported: send the prompt as text or token "
                              "ids", "prompt_embeds")
        if req.best_of not in (None, 1):
            raise bad_request("best_of must be 1: Glassbox returns one choice per request",
                              "best_of")


def max_tokens_of(req: SamplingRequest, max_model_len: int, prompt_len: int,
                  default: int | None = None) -> tuple[int, str]:
    """(max new tokens, the parameter that set it). `default`: the model card's max_new_tokens."""
    room = max(1, max_model_len - prompt_len)   # a prompt with no room: the engine refuses it
    asked, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest):
        a = req.max_completion_tokens
        if a is not None and asked is not None and a != asked:
            raise bad_request(f"max_completion_tokens={a} and max_tokens={asked} disagree; "
                              "set one", "max_completion_tokens")
        if a is not None:
            asked, param = a, "max_completion_tokens"
    if asked == 0:
        if isinstance(req, CompletionRequest) and req.echo:
            return 1, param         # the prompt alone: one token is run, and not shown
        raise bad_request(f"{param} must be at least 1 (0 only with echo: the prompt alone)",
                          param)
    if asked is None:
        base = room if isinstance(req, ChatCompletionRequest) else COMPLETIONS_DEFAULT_MAX_TOKENS
        return min(room, base, default or room), param
    if prompt_len < max_model_len and prompt_len + asked > max_model_len:
        raise bad_request(f"'{param}' is too large: {asked}. This model's maximum context "
                          f"length is {max_model_len} tokens and your request has {prompt_len} "
                          f"input tokens ({asked} > {max_model_len} - {prompt_len}); ask for at "
                          f"most {max_model_len - prompt_len}", param, "context_length_exceeded")
    return asked, param


def logprobs_of(req: SamplingRequest) -> tuple[bool, int]:
    """(logprobs wanted, how many top alternatives to show per token)."""
    if isinstance(req, ChatCompletionRequest):
        return req.logprobs, (req.top_logprobs or 0) if req.logprobs else 0
    return req.logprobs is not None, req.logprobs or 0


def prompt_logprobs_of(req: SamplingRequest) -> int | None:
    """How many top alternatives the engine computes per prompt token (None: no prompt
    logprobs): vLLM's `prompt_logprobs`, and echo with logprobs (lm-eval's loglikelihood)."""
    k = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        k = max(k or 0, req.logprobs)
    return k


def sampling_params(req: SamplingRequest, max_model_len: int, prompt_len: int,
                    defaults: dict | None = None, guided: str | None = None) -> SamplingParams:
    """SamplingParams for one prompt of the request (`prompt_len` tokens); `defaults`: the
    model card's (api.generation_config). The engine's checks become 400s naming the field."""
    refuse_unsupported(req)
    d = defaults or {}
    max_tokens, max_param = max_tokens_of(req, max_model_len, prompt_len, d.get("max_tokens"))
    wanted, top_n = logprobs_of(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())

    def pick(name: str, openai_default):
        v = getattr(req, name)
        return v if v is not None else d.get(name, openai_default)
    kw = dict(temperature=pick("temperature", 1.0), top_k=max(0, pick("top_k", 0)),
              top_p=pick("top_p", 1.0), min_p=pick("min_p", 0.0), seed=req.seed,
              max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
              stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()),
              # the engine returns the sampled token's logprob with its top-k: ask for >= 1
              logprobs=max(1, top_n) if wanted else 0,
              prompt_logprobs=prompt_logprobs_of(req),
              presence_penalty=req.presence_penalty or 0.0,
              frequency_penalty=req.frequency_penalty or 0.0,
              repetition_penalty=pick("repetition_penalty", 1.0),
              logit_bias=dict(req.logit_bias or {}), guided=guided,
              allowed_token_ids=req.allowed_token_ids, bad_words=tuple(req.bad_words or ()),
              include_stop_str_in_output=req.include_stop_str_in_output,
              skip_special_tokens=req.skip_special_tokens,
              spaces_between_special_tokens=req.spaces_between_special_tokens)
    try:
        return SamplingParams(**kw)
    except InvalidArgumentError as e:       # names its field: the message is free to change
        chat = isinstance(req, ChatCompletionRequest)
        raise bad_request(str(e), request_param(e.param, chat, max_param)) from None


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
    except InvalidArgumentError as e:
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
            content = "\n".join(texts)        # vLLM joins text parts with newlines
        else:
            content = m.content or ""
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        for key in _MESSAGE_EXTRAS:         # tool-call history, as the chat templates read it
            if (m.model_extra or {}).get(key) is not None:
                msg[key] = m.model_extra[key]
        if "reasoning_content" not in msg and isinstance((m.model_extra or {}).get("reasoning"),
                                                         str):
            msg["reasoning_content"] = m.model_extra["reasoning"]  # vLLM's newer name, sent back
        out.append(msg)
    return out


def chat_echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the text put before every choice's content, the last message's when
    its role is the reply's role (the assistant's, or with add_generation_prompt false the last
    message's own: a continued message), else nothing."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if last.role != role:
        return ""
    if isinstance(last.content, list):
        return "\n".join(p.text or "" for p in last.content)
    return last.content or ""


_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one string or token-id list, or a batch of them (vLLM and
    OpenAI accept a list of strings or a list of token-id lists; each gets its choices)."""
    p = req.prompt
    batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    for i, one in enumerate(batch):
        if not one:
            where = "prompt" if len(batch) == 1 and batch[0] is p else f"prompt[{i}]"
            raise bad_request(f"{where} is empty: give at least one character or token id",
                              "prompt")
    return batch

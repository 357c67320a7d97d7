"""A chat request's prompt: the checkpoint's chat template with the request's tools, template
variables (`chat_template_kwargs`, e.g. Qwen3's enable_thinking) and prefill choice
(`add_generation_prompt`, `continue_final_message`), encoded by engine.prompt.encode_chat so
that message text stays text. Also which reply parsers the request gets (api.chat_parsing)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.prompt import check_no_specials, encode_chat

from .errors import bad_request
from .protocol import ChatCompletionRequest

# apply_chat_template's own arguments: a request's template variables may not override them
_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
             "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer",
             "return_tensors", "padding", "truncation", "max_length"}


@dataclass(frozen=True)
class ReplyParsing:
    reasoning: bool         # split <think>...</think> into reasoning_content
    tools: bool             # parse <tool_call> blocks into tool_calls
    in_reasoning: bool      # the prompt opened <think>: the reply starts inside it

    @property
    def active(self) -> bool:
        return self.reasoning or self.tools


def chat_options(req: ChatCompletionRequest) -> dict:
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(_RESERVED & set(kwargs))
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {bad}: they are request fields of "
                          "their own", "chat_template_kwargs")
    opts = {**kwargs, "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message}
    if req.tools:
        opts["tools"] = req.tools
    return opts


def encode_chat_request(llm, req: ChatCompletionRequest, messages: list[dict]
                        ) -> tuple[list[int], str]:
    """(prompt ids, rendered text); ValueError for what the engine would refuse. Blocking."""
    tok = llm.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("this checkpoint has no chat template; use /v1/completions")
    from engine.prompt import check_prompt_chars, check_text, conversation_chars
    check_prompt_chars(conversation_chars(messages), llm.max_model_len)   # before rendering
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            check_text(m["content"], f"messages[{i}].content")
    check_no_specials(tok, "tools", req.tools)
    for i, m in enumerate(messages):
        check_no_specials(tok, f"messages[{i}].tool_calls", m.get("tool_calls"))
    try:
        return encode_chat(tok, messages, **chat_options(req))
    except (TypeError, KeyError) as e:      # a template variable of the wrong type, ...
        raise ValueError(f"the chat template failed with these options: {e}") from None
    except Exception as e:                  # jinja's TemplateError (raise_exception in a template)
        if type(e).__name__.endswith("TemplateError") or "jinja" in type(e).__module__:
            raise ValueError(f"the chat template refused this conversation: {e}") from None
        raise


def reply_parsing(llm, req: ChatCompletionRequest, rendered: str) -> ReplyParsing:
    template = getattr(llm.tokenizer, "chat_template", None)
    thinks = isinstance(template, str) and "<think>" in template
    tools = bool(req.tools) and req.tool_choice != "none"
    opened = rendered.rstrip().endswith("<think>")
    return ReplyParsing(thinks, tools, thinks and opened)

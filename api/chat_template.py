"""A chat request's template options for the engine's processor (which renders and encodes the
conversation once, message text kept as text): the request's tools, template variables
(`chat_template_kwargs`, e.g. Qwen3's enable_thinking) and prefill choice
(`add_generation_prompt`, `continue_final_message`). Also which reply parsers the request gets
(api.chat_parsing)."""
from __future__ import annotations

from dataclasses import dataclass

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


def reply_parsing(llm, req: ChatCompletionRequest, rendered: str) -> ReplyParsing:
    template = getattr(llm.tokenizer, "chat_template", None)
    thinks = isinstance(template, str) and "<think>" in template
    tools = bool(req.tools) and req.tool_choice != "none"
    opened = rendered.rstrip().endswith("<think>")
    return ReplyParsing(thinks, tools, thinks and opened)

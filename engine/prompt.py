"""Chat messages -> prompt token ids, with message text kept as text: only the special tokens
the *template* placed become control tokens, so `<|im_start|>` typed inside a message cannot
close the user's turn and open a system one (role injection). A chat whose messages hold no
special-token text encodes exactly as `tokenizer.encode(apply_chat_template(...))`.
"""
from __future__ import annotations

import re
import secrets
import threading
import weakref
from typing import NamedTuple

from .errors import InvalidArgumentError, PromptTooLongError


# characters per token a prompt may average before it is refused without tokenizing it: a
# generous bound (English text is ~4 characters a token, the demo's longest token is 16; Qwen's
# longest are whitespace and punctuation runs), so only a prompt that could not fit anyway is
# refused, in O(1), instead of after seconds of tokenizing
MAX_CHARS_PER_TOKEN = 16


def check_prompt_chars(num_chars: int, max_model_len: int) -> None:
    """PromptTooLongError when a prompt of `num_chars` characters cannot fit max_model_len
    tokens at MAX_CHARS_PER_TOKEN characters a token: checked before tokenizing."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise PromptTooLongError(
            f"prompt has {num_chars:,} characters, more than {limit:,} ({MAX_CHARS_PER_TOKEN} "
            f"a token x max_model_len {max_model_len}): it cannot fit the model's context; "
            "shorten the prompt")


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str = "prompt") -> None:
    """InvalidArgumentError for a lone UTF-16 surrogate (JSON's "\\ud800"): it is no
    character, cannot be encoded as UTF-8, and would fail deep inside the tokenizer."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise InvalidArgumentError(f"{where} holds a lone surrogate {m.group()!r} at character "
                                   f"{m.start()}: that is not a valid Unicode character; send "
                                   "UTF-8 text", where)


def conversation_chars(messages) -> int:
    """Characters of a conversation's text (message contents and roles), before rendering."""
    return sum(len(v) for m in messages if isinstance(m, dict)
               for v in (m.get("content"), m.get("role")) if isinstance(v, str))


def check_messages(messages) -> None:
    """An InvalidArgumentError naming the message and field for anything but
    [{role: str, content: str}]."""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidArgumentError(f"{where} must be a dict with 'role' and 'content', "
                                       f"got {type(m).__name__}", where)
        if "role" not in m or "content" not in m:
            raise InvalidArgumentError(f"{where} needs 'role' and 'content' keys, got "
                                       f"{sorted(m)}", where)
        if not isinstance(m["role"], str):
            raise InvalidArgumentError(f"{where}.role must be a string, got {m['role']!r}",
                                       f"{where}.role")
        if not isinstance(m["content"], str):
            raise InvalidArgumentError(f"{where}.content must be a string, "
                                       f"got {type(m['content']).__name__}", f"{where}.content")


def render_chat(tokenizer, messages: list[dict], **options) -> str:
    """`options`: apply_chat_template's (tools, add_generation_prompt, continue_final_message)
    and the template's own variables (enable_thinking, ...)."""
    options.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(messages, tokenize=False, **options)


def check_no_specials(tokenizer, what: str, value) -> None:
    """Text the template places outside message content (tool definitions, tool-call arguments)
    may not hold special-token text: it would become control tokens."""
    if not value:
        return
    text = value if isinstance(value, str) else repr(value)
    hit = next((t for t in _special_tokens(tokenizer) if t in text), None)
    if hit is not None:
        raise InvalidArgumentError(f"{what} contains the special token {hit!r}, which the chat "
                                   "template would turn into a control token; remove it", what)


def encode_chat(tokenizer, messages: list[dict], **options) -> tuple[list[int], str]:
    """(prompt token ids, rendered text) of a conversation, ready for the assistant's reply
    (or, with continue_final_message, for more of its last message). `options`: render_chat's."""
    check_messages(messages)
    messages = [dict(m) for m in messages]
    text = render_chat(tokenizer, messages, **options)
    specials = _special_tokens(tokenizer)
    if not specials:
        return tokenizer.encode(text, add_special_tokens=False), text
    spans = _content_spans(tokenizer, messages, text, specials, options)
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    pending = ""        # template text since the last template special
    pos = 0
    for start, end in _gaps(spans, len(text)):
        # spans are message text: never searched for specials; gaps are template text
        for m in pattern.finditer(text, start, end):
            tok = specials[m.group()]
            pending += text[pos:m.start()]
            if tok.lstrip:          # the token absorbs whitespace on its left, as encode does
                pending = pending.rstrip()
            ids += _encode_plain(tokenizer, pending)
            ids.append(tok.id)
            pending, pos = "", m.end()
            if tok.rstrip:
                while pos < len(text) and text[pos].isspace():
                    pos += 1
    ids += _encode_plain(tokenizer, pending + text[pos:])
    return ids, text


class _Special(NamedTuple):
    id: int
    lstrip: bool
    rstrip: bool


def _special_tokens(tokenizer) -> dict[str, _Special]:
    """Special token text -> its id (and whitespace handling)."""
    out = {}
    for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if t.special and t.content:
            out[t.content] = _Special(i, bool(t.lstrip), bool(t.rstrip))
    for t in getattr(tokenizer, "all_special_tokens", []):
        if t and t not in out:
            i = tokenizer.convert_tokens_to_ids(t)
            if isinstance(i, int):
                out[t] = _Special(i, False, False)
    return out


def _gaps(spans: list[tuple[int, int]], n: int):
    """The (start, end) ranges of [0, n) outside the sorted, disjoint spans."""
    pos = 0
    for s, e in spans:
        if s > pos:
            yield pos, s
        pos = max(pos, e)
    if pos < n:
        yield pos, n


def _content_spans(tokenizer, messages: list[dict], text: str,
                   specials: dict, options: dict | None = None) -> list[tuple[int, int]]:
    """Where each message's content sits in the rendered text, found by rendering again with a
    unique marker in place of the content. A template that rewrites a message's content (e.g.
    strips a reasoning block) gives no span for it; such content may not hold special tokens."""
    tag = secrets.token_hex(8)
    marks = re.compile(f"\ue000{tag}(\\d+)\ue001")

    def attempt(which: set[int]):
        marked = render_chat(tokenizer, [
            dict(m, content=f"\ue000{tag}{i}\ue001") if i in which else m
            for i, m in enumerate(messages)], **(options or {}))
        parts = marks.split(marked)        # [literal, index, literal, index, ..., literal]
        rebuilt, spans, seen = parts[0], [], set()
        for k in range(1, len(parts), 2):
            i = int(parts[k])
            content = messages[i]["content"]
            spans.append((len(rebuilt), len(rebuilt) + len(content)))
            seen.add(i)
            rebuilt += content + parts[k + 1]
        return spans if rebuilt == text and seen == which else None

    everyone = set(range(len(messages)))
    verbatim, spans = everyone, attempt(everyone)
    if spans is None:           # one message at a time: which ones does the template keep?
        verbatim = {i for i in everyone if attempt({i}) is not None}
        spans = attempt(verbatim)
        if spans is None:
            verbatim, spans = set(), []
    for i in sorted(everyone - verbatim):
        hit = next((t for t in specials if t in messages[i]["content"]), None)
        if hit is not None:
            raise InvalidArgumentError(
                f"messages[{i}].content contains the special token {hit!r}, and this chat "
                "template rewrites that message, so it cannot be kept as plain text; remove the "
                "special token from the message", f"messages[{i}].content")
    return sorted(s for s in spans if s[0] < s[1])


# special tokens are never recognised in message text: a private copy of the fast tokenizer's
# backend with encode_special_tokens on (the tokenizer's own split_special_tokens flips a flag
# shared by every thread that encodes, so a concurrent plain encode could see it)
_PLAIN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PLAIN_LOCK = threading.Lock()


def _encode_plain(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:         # a slow tokenizer: its own flag (none of Qwen's are slow)
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    with _PLAIN_LOCK:
        plain = _PLAIN.get(tokenizer)
        if plain is None:
            from tokenizers import Tokenizer
            plain = Tokenizer.from_str(backend.to_str())
            plain.encode_special_tokens = True
            _PLAIN[tokenizer] = plain
    # encode_batch, not encode: it releases the GIL while the Rust code runs, so a long prompt
    # being tokenized on a worker thread never stalls the engine loop or other streams
    # (encode holds the GIL: 1 MB of text froze every stream for 1.5 s)
    return plain.encode_batch([text], add_special_tokens=False)[0].ids

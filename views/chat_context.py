"""What the chat sends: the conversation trimmed to the model's context, oldest turns first.

A conversation grows with every reply, and `max_model_len` bounds prompt + reply. Rather than
refuse the next message once the history is too long (a dead end: every later message fails
too), the oldest user/assistant turns are dropped until the prompt and the reply's budget fit.
The system prompt and the new message are never dropped; a message that cannot fit even alone
gets an error that says how long it is and what the limit is.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

Messages = list[dict]


class Fitted(NamedTuple):
    """The messages to send, how many earlier turns were left out, the prompt's length and the
    reply budget that is left (max tokens, or less when the prompt leaves less room)."""
    messages: Messages
    dropped_turns: int
    prompt_tokens: int
    reply_budget: int


def split_turns(history: Messages) -> list[Messages]:
    """Turns of a chat history: each user message with the replies that follow it (a turn is
    dropped whole, so the model never sees a reply without its question)."""
    turns: list[Messages] = []
    for m in history:
        if m.get("role") == "user" or not turns:
            turns.append([])
        turns[-1].append(m)
    return turns


def fit_conversation(system: Messages, history: Messages, message: dict, reply_budget: int,
                     max_model_len: int, count: Callable[[Messages], int]) -> Fitted:
    """`system` + the newest turns of `history` that fit + `message`, so that the prompt plus
    `reply_budget` tokens fit `max_model_len`; `count` gives a message list's prompt tokens.

    Raises ValueError when `system` + `message` alone leave no room for one reply token."""
    turns = split_turns(history)
    alone = count(system + [message])
    if alone >= max_model_len:
        raise ValueError(
            f"This message is too long for the model: with the system prompt it is {alone:,} "
            f"tokens, and this model holds {max_model_len:,} tokens of prompt + reply. "
            f"Shorten the message (or the system prompt).")
    # drop turns oldest-first until it fits: binary search on how many to keep (counting a
    # prompt renders the template, so keep the number of renders small for long chats)
    lo, hi = 0, len(turns)          # keep the newest `k` turns; k = lo always fits
    while lo < hi:
        k = (lo + hi + 1) // 2
        n = count(system + [m for t in turns[len(turns) - k:] for m in t] + [message])
        if n + reply_budget <= max_model_len:
            lo = k
        else:
            hi = k - 1
    kept = [m for t in turns[len(turns) - lo:] for m in t] if lo else []
    msgs = system + kept + [message]
    n = count(msgs) if lo else alone
    return Fitted(msgs, len(turns) - lo, n, max(1, min(reply_budget, max_model_len - n)))


def context_line(max_model_len: int, reply_budget: int, prompt_tokens: int | None = None,
                 dropped: int = 0) -> str:
    """The line beside the chat: the model's context, the reply budget, the last prompt."""
    line = (f"context **{max_model_len:,}** tokens (prompt + reply) · reply budget "
            f"**{reply_budget:,}** (max tokens)")
    if prompt_tokens is not None:
        line += f" · last prompt **{prompt_tokens:,}** tokens"
    if dropped:
        line += (f" · ✂ the {dropped} oldest turn{'s' if dropped != 1 else ''} left out to fit "
                 "(the system prompt and your message always go)")
    return line

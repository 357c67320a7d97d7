"""vLLM's per-request token filters, built once per request by the processor: `allowed_token_ids`
becomes a static row of the step's token bitmask (beside a grammar's, engine/grammar_masks.py);
a `bad_words` word's last token joins the step's banned (row, token) pairs (engine_core._banned).

bad_words, as vLLM defines it: each word is tokenized as it is and after a space; the last token
of such a sequence is banned at a step where the output's last tokens equal the rest of it (a
one-token word at every step). Only output tokens are compared, as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError


def allowed_bitmask(token_ids, vocab_size: int) -> np.ndarray:
    """[ceil(V/32)] uint32: bit t set = token t allowed (the grammar masks' layout)."""
    bits = np.zeros(((vocab_size + 31) // 32) * 32, dtype=np.uint8)
    bits[np.asarray(token_ids, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)


def bad_word_sequences(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """The token sequences of each word, bare and after a space (distinct ones only)."""
    if tokenizer is None:
        raise InvalidArgumentError("bad_words needs the checkpoint's tokenizer", "bad_words")
    out: dict[tuple[int, ...], None] = {}
    for w in words:
        w = w.lstrip()
        for text in (w, " " + w):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


class BadWords:
    """A request's bad-word sequences, grouped for a per-step lookup: the tokens banned always,
    and for each prefix length the last tokens banned after that prefix."""

    def __init__(self, sequences: tuple[tuple[int, ...], ...]):
        self.always = tuple(sorted({s[0] for s in sequences if len(s) == 1}))
        self.after: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for s in sequences:
            if len(s) > 1:
                self.after.setdefault(len(s) - 1, {}).setdefault(s[:-1], []).append(s[-1])

    @property
    def needs_history(self) -> bool:
        """A multi-token word: the mask depends on the newest output tokens."""
        return bool(self.after)

    def banned(self, output_ids: list[int]) -> list[int]:
        """The tokens banned at the next step, after `output_ids` (all known on the host)."""
        out = list(self.always)
        for n, table in self.after.items():
            if len(output_ids) >= n:
                out += table.get(tuple(output_ids[-n:]), ())
        return out


@dataclass(frozen=True)
class TokenFilter:
    """What one request masks beyond its grammar: None / empty when it masks nothing."""
    allowed: np.ndarray | None = None       # allowed_bitmask of allowed_token_ids
    bad_words: BadWords | None = None


def token_filter(params, tokenizer, vocab_size: int) -> TokenFilter | None:
    """The request's TokenFilter (built once, off the engine thread), or None."""
    if params.allowed_token_ids is None and not params.bad_words:
        return None
    allowed = None if params.allowed_token_ids is None else allowed_bitmask(
        params.allowed_token_ids, vocab_size)
    bad = None
    if params.bad_words:
        seqs = bad_word_sequences(tokenizer, params.bad_words)
        bad_ids = [t for s in seqs for t in s if t >= vocab_size]
        if bad_ids:
            raise InvalidArgumentError(f"bad_words tokenize to ids {bad_ids[:5]} outside the "
                                       f"vocabulary [0, {vocab_size})", "bad_words")
        bad = BadWords(seqs) if seqs else None
    return TokenFilter(allowed, bad)

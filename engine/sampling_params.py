"""SamplingParams: one request's sampling settings as the user gives them, validated at
construction; every bad value raises InvalidArgumentError whose `param` is the field's name.
Apart from the device sampler (engine/sampling.py): a caller needs no torch, and the sampler,
its fused kernel and their shared noise form no import cycle with it.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

from .errors import InvalidArgumentError

SEED_RANGE = (-(1 << 63), 1 << 63)     # the noise hash takes any int64 seed
MAX_TOP_K = 1 << 31                      # above any vocabulary; top_k >= vocab keeps every token
MAX_LOGPROBS = 20
# bad_words are checked against the output at every step of the request: bounded like stop strings
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256


def is_int(v) -> bool:
    """An int the way a request means it: numpy ints count, bools do not."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _number(name: str, v, lo: float = -math.inf, hi: float = math.inf, what: str = "",
            open_lo: bool = False) -> float:
    """v as a finite float in [lo, hi] ((lo, hi] with open_lo), else an error saying `what`."""
    if not is_number(v):
        raise InvalidArgumentError(f"{name} must be a number, got {v!r} "
                                   f"({type(v).__name__})", name)
    v = float(v)
    if not math.isfinite(v):
        raise InvalidArgumentError(f"{name} must be finite, got {v!r}", name)
    if v < lo or (open_lo and v == lo) or v > hi:
        raise InvalidArgumentError(f"{name} must be {what}, got {v!r}", name)
    return v


def _int(name: str, v, lo: int, hi: int | None, what: str) -> int:
    """v as a Python int in [lo, hi) (hi None: no upper bound), else an error saying `what`."""
    if not is_int(v) or v < lo or (hi is not None and v >= hi):
        raise InvalidArgumentError(f"{name} must be {what}, got {v!r}", name)
    return int(v)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, checked at construction and immutable after, so what the
    engine samples with is what was validated. `check_for_model` adds the checks that need the
    model (token ids against the vocabulary); the engine calls it when a request is submitted."""
    temperature: float = 1.0        # 0 means greedy
    top_k: int = 0                  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    logprobs: int = 0               # k: return the top-k logprobs of every generated token
    prompt_logprobs: int | None = None  # k: each prompt token's logprob (+ top-k), from the prefill
    presence_penalty: float = 0.0   # OpenAI's, in [-2, 2] (engine/penalties.py defines them)
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    repetition_penalty: float = 1.0     # HF's / vLLM's, > 0 (1 = off)
    logit_bias: tuple[tuple[int, float], ...] | dict = ()   # token id -> bias in [-100, 100]
    guided: str | dict | None = None    # a grammar the output must match (engine/guided.py)
    # vLLM's output and masking fields (engine/token_filters.py, engine/detokenizer.py)
    allowed_token_ids: tuple[int, ...] | list[int] | None = None    # only these are sampled
    bad_words: tuple[str, ...] | list[str] = ()     # words whose tokens are never completed
    include_stop_str_in_output: bool = False    # the stop string (or stop token) ends the text
    skip_special_tokens: bool = True            # special tokens left out of the text
    spaces_between_special_tokens: bool = True  # a slow tokenizer's spacing (fast ones: none)
    # speculative decoding (engine/spec_decode): None = the engine's setting, 0 = off for this
    # request, k = up to k drafts per step (with the engine's method, n-gram by default)
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)     # the dataclass is frozen
        put("temperature", _number("temperature", self.temperature, 0.0,
                                   what=">= 0 (0 = greedy)"))
        put("top_p", _number("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", open_lo=True))
        put("min_p", _number("min_p", self.min_p, 0.0, 1.0, "in [0, 1]"))
        put("top_k", _int("top_k", self.top_k, 0, MAX_TOP_K,
                          "an integer in [0, 2**31) (0 = off)"))
        if self.seed is not None:
            put("seed", _int("seed", self.seed, *SEED_RANGE,
                             "None or an integer in [-2**63, 2**63)"))
        put("max_tokens", _int("max_tokens", self.max_tokens, 1, None, "a positive integer"))
        put("min_tokens", _int("min_tokens", self.min_tokens, 0, self.max_tokens + 1,
                               f"an integer in [0, max_tokens={self.max_tokens}]"))
        put("logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1,
                             f"an integer in [0, {MAX_LOGPROBS}]"))
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, 0,
                                        MAX_LOGPROBS + 1,
                                        f"None or an integer in [0, {MAX_LOGPROBS}]"))
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _number(name, getattr(self, name), -2.0, 2.0, "in [-2, 2] (0 = off)"))
        put("repetition_penalty", _number("repetition_penalty", self.repetition_penalty, 0.0,
                                          100.0, "in (0, 100] (1 = off)", open_lo=True))
        bias = self.logit_bias
        bad_bias = InvalidArgumentError(f"logit_bias must map token ids (>= 0) to numbers in "
                                        f"[-100, 100], got {bias!r}", "logit_bias")
        if not isinstance(bias, (dict, list, tuple)):
            raise bad_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple((int(k), _number("logit_bias", v)) for k, v in items
                          if is_int(k) or (isinstance(k, str) and k.lstrip("-").isdigit()))
        except (TypeError, ValueError):
            raise bad_bias from None
        if len(pairs) != len(bias) or any(t < 0 or not -100 <= v <= 100 for t, v in pairs):
            raise bad_bias
        put("logit_bias", pairs)
        if self.guided is not None:
            from .guided import grammar_of
            put("guided", grammar_of(self.guided))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False, got "
                                           f"{getattr(self, name)!r}", name)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not all(is_int(i) and i >= 0
                                                                 for i in allowed):
                raise InvalidArgumentError(f"allowed_token_ids must be a list of token ids "
                                           f"(integers >= 0), got {allowed!r:.80}",
                                           "allowed_token_ids")
            if not allowed:
                raise InvalidArgumentError("allowed_token_ids is empty: no token could be "
                                           "sampled; give at least one id, or leave it out",
                                           "allowed_token_ids")
            put("allowed_token_ids", tuple(sorted({int(i) for i in allowed})))
        words = self.bad_words
        if isinstance(words, str) or not isinstance(words, (list, tuple)) or \
                not all(isinstance(w, str) and w.strip() for w in words):
            raise InvalidArgumentError(f"bad_words must be a list of non-empty strings, got "
                                       f"{words!r:.80}", "bad_words")
        if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in words):
            raise InvalidArgumentError(f"bad_words holds at most {MAX_BAD_WORDS} words of at "
                                       f"most {MAX_BAD_WORD_CHARS} characters each",
                                       "bad_words")
        put("bad_words", tuple(words))
        if self.num_speculative_tokens is not None:
            _int("num_speculative_tokens", self.num_speculative_tokens, 0, 17,
                 "None (the engine's setting), 0 (off) or an integer in 1..16")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgumentError(f"stop must be a string or a list of strings, got "
                                       f"{self.stop!r}", "stop")
        if any(not s for s in stop):
            raise InvalidArgumentError("stop strings must be non-empty", "stop")
        put("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
            raise InvalidArgumentError(f"stop_token_ids must be a list of token ids (integers "
                                       f">= 0), got {ids!r}", "stop_token_ids")
        put("stop_token_ids", tuple(int(i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def summary(self) -> str:
        """The choices that differ from the defaults, in a few words (the playground's row);
        built once per request (cached_property writes past the frozen __setattr__)."""
        parts = ["greedy" if self.greedy else f"temp {self.temperature:g}"]
        for name, label, off in (("top_k", "top_k", 0), ("top_p", "top_p", 1.0),
                                 ("min_p", "min_p", 0.0), ("presence_penalty", "presence", 0.0),
                                 ("frequency_penalty", "frequency", 0.0),
                                 ("repetition_penalty", "repetition", 1.0)):
            v = getattr(self, name)
            if v != off:
                parts.append(f"{label} {v:g}")
        if self.logit_bias:
            parts.append(f"logit_bias {len(self.logit_bias)} tok")
        if self.seed is not None:
            parts.append(f"seed {self.seed}")
        parts.append(f"max {self.max_tokens}")
        if self.min_tokens:
            parts.append(f"min {self.min_tokens}")
        if self.guided is not None:
            parts.append("guided")
        if self.allowed_token_ids is not None:
            parts.append(f"allowed {len(self.allowed_token_ids)} tok")
        if self.bad_words:
            parts.append(f"bad_words {len(self.bad_words)}")
        return " · ".join(parts)

    @property
    def uses_penalties(self) -> bool:
        """A presence / frequency / repetition penalty or a logit_bias (engine/penalties.py)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))

    def check_for_model(self, vocab_size: int) -> None:
        """The checks that need the model: token ids inside its vocabulary [0, vocab_size)."""
        for name, label, ids in (
                ("logit_bias", "logit_bias token ids", [t for t, _ in self.logit_bias]),
                ("allowed_token_ids", "allowed_token_ids", self.allowed_token_ids or ()),
                ("stop_token_ids", "stop_token_ids", self.stop_token_ids)):
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise InvalidArgumentError(f"{label} {bad[:5]} are outside the vocabulary [0, "
                                           f"{vocab_size}); give token ids of this model", name)
        if self.logprobs > vocab_size:
            raise InvalidArgumentError(f"logprobs={self.logprobs} exceeds the vocabulary size "
                                       f"{vocab_size}", "logprobs")

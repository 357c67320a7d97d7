"""Grammar-guided decoding (structured output) through llguidance: a request's grammar (JSON
schema, regex, Lark, in llguidance's grammar JSON) becomes a matcher; each step the host fills
the guided rows' token bitmask, the sampler masks their logits, each sampled token advances it.

Why llguidance (over xgrammar): a wheel with no dependencies, no per-schema compile step (its
lazy Earley parser makes an arbitrary per-request schema cheap), full JSON schema and Lark, and
both vLLM and SGLang ship it as a backend.
"""
from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from .errors import InvalidArgumentError

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ll():
    try:
        import llguidance
        import llguidance.hf
        return llguidance
    except ImportError:
        raise InvalidArgumentError(
            "guided decoding (response_format, grammars) needs the llguidance "
            "package: pip install llguidance", "guided") from None


class GrammarText(str):
    """A grammar (llguidance's JSON) and the regexes it will lex lazily, long after its first
    mask (a JSON schema's `pattern`s): the processor tries each of those alone as well."""
    lexemes: tuple[str, ...] = ()


MAX_SCHEMA_PATTERNS = 64    # `pattern`s one schema may hold (each is tried when processed)


def json_schema_grammar(schema: dict | bool) -> str:
    """llguidance's grammar for JSON matching `schema` ({"type": "object"} = any object).
    Whitespace is fixed (", " and ": " between items, none elsewhere), as vLLM's guidance
    backend does by default: free whitespace lets a small model pad forever."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"a JSON schema must be an object, got {schema!r}", "guided")
    opts = {"whitespace_flexible": False, **schema.get("x-guidance", {})}
    g = GrammarText(_ll().LLMatcher.grammar_from_json_schema({**schema, "x-guidance": opts}))
    g.lexemes = _patterns(schema)
    return g


def _patterns(schema: dict) -> tuple[str, ...]:
    """Every string-valued `pattern` in the schema (iteratively: a schema may nest deeply)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    if len(found) > MAX_SCHEMA_PATTERNS:
        raise InvalidArgumentError(f"the schema holds {len(found)} `pattern`s; at most "
                                   f"{MAX_SCHEMA_PATTERNS} are allowed", "guided")
    return tuple(dict.fromkeys(found))


def regex_grammar(pattern: str) -> str:
    return _ll().LLMatcher.grammar_from_regex(pattern)


class Grammar:
    """One request's matcher, the vocabulary width its masks cover, and what it has done."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.num_consumed = 0               # output tokens the matcher has advanced past
        self.num_allowed: int | None = None  # tokens its latest mask allowed (None: none yet)

    def consume_at(self, index: int, token: int) -> None:
        """Advance past output token `index`; a second call for the same index is a no-op
        (under overlap scheduling the engine advances early, to fill the next step's mask,
        and again when it postprocesses). ValueError if the grammar does not allow it."""
        if index < self.num_consumed:
            return
        if index != self.num_consumed:
            raise RuntimeError(f"the grammar is at output token {self.num_consumed}, asked to "
                               f"consume token {index}")
        if not self.matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.num_consumed += 1

    def consume(self, token: int) -> None:
        self.consume_at(self.num_consumed, token)

    def copy(self) -> "Grammar":
        """A matcher of the same grammar for another request (n > 1), at this one's state."""
        return Grammar(self.matcher.deep_copy(), self.vocab_size)

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's allowed bits into `row` ([ceil(V/32)] uint32, contiguous, on
        the host). A matcher in error (its request fails when postprocessed) allows all."""
        if self.matcher.is_error():
            row.fill(0xFFFFFFFF)
        else:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.num_allowed = int(np.bitwise_count(row).sum())


# llguidance's own resource limits, tighter than its defaults (which let one request's mask
# take ~0.7 s and ~100 MB): a grammar that needs more is refused when the request is processed,
# and a later step that would need more fails that request alone. Fuel runs ~14k a ms per mask
# step, so a step's mask is bounded at a few ms whatever the grammar.
# (initial_lexer_fuel is what bounds a counted repetition: at 50k, e.g. a{30000} is refused in
# ~25 ms, while emails, UUIDs, dates, enums and a{3000} compile as before)
GRAMMAR_LIMITS = dict(step_lexer_fuel=50_000, initial_lexer_fuel=50_000,
                      max_lexer_states=25_000, step_max_items=20_000, verbose_errors=False)
TRIAL_STEPS = 4     # tokens the trial walks past the first mask (lexemes are built lazily)
# the first mask is computed when the request is processed (off the engine thread): a grammar
# whose first mask takes longer than this is refused before it costs anyone a step
FIRST_MASK_BUDGET_S = 0.25


def make_matcher(tokenizer, vocab_size: int, eos_ids, grammar: str) -> Grammar:
    """A fresh matcher for one request, its first mask computed once as a trial (within
    GRAMMAR_LIMITS and FIRST_MASK_BUDGET_S); an InvalidArgumentError naming the problem for a
    grammar that is malformed or too costly."""
    if tokenizer is None:
        raise InvalidArgumentError("guided decoding needs the checkpoint's tokenizer", "guided")
    ll = _ll()
    llt = _TOKENIZERS.get(tokenizer)        # llguidance's view of it, built once per tokenizer
    if llt is None:
        llt = _TOKENIZERS[tokenizer] = ll.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                            eos_token=sorted(eos_ids) or None)
    limits = ll.LLParserLimits(**GRAMMAR_LIMITS)
    err = ll.LLMatcher.validate_grammar(grammar, llt, limits=limits)
    if err:
        raise InvalidArgumentError(f"the grammar / schema cannot be used: {err}", "guided")
    m = ll.LLMatcher(llt, grammar, log_level=0, limits=limits)
    t0 = time.perf_counter()
    _trial(m.deep_copy(), vocab_size)
    took = time.perf_counter() - t0
    if m.is_error():
        raise InvalidArgumentError(f"the grammar / schema cannot be used: {_first_line(m)}",
                                   "guided")
    if took > FIRST_MASK_BUDGET_S:
        raise InvalidArgumentError(f"the grammar / schema is too costly: its first token masks "
                                   f"took {took:.2f} s (the budget is {FIRST_MASK_BUDGET_S} s); "
                                   "simplify it", "guided")
    for pattern in getattr(grammar, "lexemes", ()):     # lexed lazily: try each one now
        try:
            make_matcher(tokenizer, vocab_size, eos_ids, regex_grammar(pattern))
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"the schema's pattern {pattern!r:.80} cannot be used: "
                                       f"{e}", "guided") from None
    return Grammar(m, vocab_size)


def _trial(m, vocab_size: int) -> None:
    """Compute the first masks of a copy of the request's matcher, walking TRIAL_STEPS tokens
    (each time the first one allowed that is not the end): lexemes a grammar builds lazily at
    its start are built now, within its limits. InvalidArgumentError if the grammar fails."""
    row = np.empty((vocab_size + 31) // 32, dtype=np.uint32)
    for _ in range(TRIAL_STEPS + 1):
        if m.is_error() or m.is_stopped():
            break
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if m.is_error():
            break
        bits = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        tok = next((int(t) for t in bits if t < vocab_size and not m.is_accepting()), None)
        if tok is None or not m.consume_token(tok):
            break
    if m.is_error():
        raise InvalidArgumentError(f"the grammar / schema cannot be used: {_first_line(m)} "
                                   "(llguidance's limits bound what one request's grammar may "
                                   "cost; simplify it, e.g. fewer or smaller counted "
                                   "repetitions)", "guided")


def _first_line(m) -> str:
    return (m.get_error() or "unknown error").strip().splitlines()[0]


def lark_grammar(lark: str) -> str:
    """llguidance's grammar for a Lark grammar (with %json sub-grammars)."""
    return _ll().LLMatcher.grammar_from_lark(lark)


def grammar_from_text(text: str) -> str:
    """llguidance's grammar for a grammar in Lark or in GBNF / EBNF (told apart by syntax; GBNF
    is converted to Lark). ValueError for one that cannot be converted."""
    return _ll().grammar_from("grammar", text)


def struct_tag_grammar(tags: list[tuple[str, str, dict | str, str]]) -> str:
    """llguidance's grammar for structural tags, each (trigger, begin, JSON schema or Lark,
    end): free text, and after a trigger the tag's begin, body and end. Triggers are matched as
    text (Qwen's <tool_call> is an ordinary added token, not a special one)."""
    ll = _ll()
    try:
        return ll.StructTag.to_grammar(
            [ll.StructTag(trigger=t, begin=b, grammar=g, end=e) for t, b, g, e in tags],
            assume_special=False)
    except AssertionError as e:
        raise ValueError(f"bad structural tag: {e}") from None


_POW2: dict = {}


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32, mask [B, ceil(V/32)] int32 on the same device -> disallowed = -inf.
    On a GPU one Triton launch (kernels/bitmask_kernel.py); the torch reference below (the CPU
    path) is two [B, V] passes: the bits against a cached table of powers of two, the fill."""
    if logits.is_cuda:
        from .kernels.bitmask_kernel import apply_bitmask_kernel
        return apply_bitmask_kernel(logits, mask)
    return apply_bitmask_ref(logits, mask)


def apply_bitmask_ref(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The torch reference of apply_bitmask (ids past the mask's 32 * W bits are forbidden)."""
    v = logits.shape[-1]
    if mask.shape[1] * 32 < v:          # a vocabulary padded past the tokenizer's
        mask = torch.nn.functional.pad(mask, (0, (v + 31) // 32 - mask.shape[1]))
    pow2 = _POW2.get(logits.device)
    if pow2 is None:    # 1 << 31 wraps to int32's sign bit, which is what bit 31 tests
        pow2 = _POW2[logits.device] = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)],
                                                   dtype=torch.int32, device=logits.device)
    banned = (mask[:, :, None] & pow2) == 0
    return logits.masked_fill(banned.view(mask.shape[0], -1)[:, :v], float("-inf"))


def grammar_of(spec) -> str:
    """SamplingParams.guided: a grammar string as is; a dict {"json_schema": ...} /
    {"regex": ...} built here."""
    if isinstance(spec, str):       # checked against the tokenizer in make_matcher
        return spec
    if isinstance(spec, dict) and "json_schema" in spec:
        return json_schema_grammar(spec["json_schema"])
    if isinstance(spec, dict) and "regex" in spec:
        return regex_grammar(spec["regex"])
    raise InvalidArgumentError(f"guided must be a grammar string or {{'json_schema': ...}} / "
                               f"{{'regex': ...}}, got {spec!r}", "guided")

"""Grammar-guided decoding (structured output) through llguidance: a request's grammar (a JSON
schema, a regex, a Lark grammar, in llguidance's grammar JSON) becomes a matcher on its
Sequence; each step the host fills the token bitmask of the guided rows from their matchers,
the sampler masks those rows' logits on the device, and each sampled token advances its matcher.

Why llguidance (over xgrammar): a wheel with no dependencies (xgrammar pins torch, triton and
transformers ranges of its own), no per-schema compile step (its Earley parser with a lexer
works lazily, so an arbitrary per-request schema costs no upfront compilation), full JSON
schema and Lark, and both vLLM and SGLang ship it as a backend.
"""
from __future__ import annotations

from .errors import InvalidArgumentError

import weakref

import numpy as np
import torch

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


def json_schema_grammar(schema: dict | bool) -> str:
    """llguidance's grammar for JSON matching `schema` ({"type": "object"} = any object).
    Whitespace is fixed (", " and ": " between items, none elsewhere), as vLLM's guidance
    backend does by default: free whitespace lets a small model pad forever."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"a JSON schema must be an object, got {schema!r}", "guided")
    opts = {"whitespace_flexible": False, **schema.get("x-guidance", {})}
    return _ll().LLMatcher.grammar_from_json_schema({**schema, "x-guidance": opts})


def regex_grammar(pattern: str) -> str:
    return _ll().LLMatcher.grammar_from_regex(pattern)


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """The llguidance view of the engine's tokenizer (built once per tokenizer)."""
    ll = _ll()
    cached = _TOKENIZERS.get(tokenizer)
    if cached is None:
        cached = ll.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                      eos_token=sorted(eos_ids) or None)
        _TOKENIZERS[tokenizer] = cached
    return cached


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

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's allowed bits into `row` ([ceil(V/32)] uint32, contiguous, on
        the host). A matcher in error (its request fails when postprocessed) allows all."""
        if self.matcher.is_error():
            row.fill(0xFFFFFFFF)
        else:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.num_allowed = int(np.bitwise_count(row).sum())


def make_matcher(tokenizer, vocab_size: int, eos_ids, grammar: str) -> Grammar:
    """A fresh matcher for one request; ValueError naming the problem for a bad grammar."""
    if tokenizer is None:
        raise InvalidArgumentError("guided decoding needs the checkpoint's tokenizer", "guided")
    ll = _ll()
    llt = ll_tokenizer(tokenizer, vocab_size, eos_ids)
    err = ll.LLMatcher.validate_grammar(grammar, llt)
    if err:
        raise InvalidArgumentError(f"the grammar / schema cannot be used: {err}", "guided")
    m = ll.LLMatcher(llt, grammar)
    if m.is_error():
        raise InvalidArgumentError(f"the grammar / schema cannot be used: {m.get_error()}", "guided")
    return Grammar(m, vocab_size)


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

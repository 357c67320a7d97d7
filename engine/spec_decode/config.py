"""SpeculativeConfig: vLLM's `--speculative-config` JSON, checked once with errors that name
the field (`speculative_config.num_speculative_tokens`). Two methods, as vLLM spells them:
"ngram" (prompt lookup) and "draft_model" (a smaller checkpoint's `model`, implied by `model`).
Whether the draft loads and shares the target's tokenizer is checked when the engine loads it
(spec_decode/draft_model.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..sampling_params import is_int, is_number

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16     # more rows than this per verify only wastes the forward


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _positive_int(name: str, v, hi: int | None = None) -> int:
    if not is_int(v) or v < 1 or (hi is not None and v > hi):
        rng = f"1..{hi}" if hi is not None else ">= 1"
        raise InvalidArgumentError(f"{_field(name)} must be an integer in {rng}, got {v!r}",
                                   _field(name))
    return int(v)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None        # draft_model: the draft checkpoint (a directory or hub id)
    # vLLM's key: the draft runs unsharded on rank 0 (in the calling process), so only 1
    draft_tensor_parallel_size: int = 1
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # adaptive back-off (spec_decode/state.py): a request whose verifies accepted fewer than
    # this share of their k draft slots over its last `adaptive_window` proposals (judged from
    # its 8th on, beyond noise) stops speculating for good: a verify costs ~2 plain steps
    # (bench/RESULTS.md 2026-12-06), so below ~1 + 0.3 k tokens a verify plain decoding is faster
    adaptive_min_acceptance: float = 0.3
    adaptive_window: int = 32
    # vLLM's key: no request drafts in a step while more than this many run. A verify row costs
    # a full token of compute, and a large batch is past the bandwidth floor that speculation
    # beats: there the extra rows (and the plain rows' lost overlap) only slow every request
    disable_by_batch_size: int = 32

    def __post_init__(self):
        if self.method not in METHODS:
            hint = (" (EAGLE, MTP and Medusa heads are not served: use 'ngram', or a draft "
                    "checkpoint as `model`)"
                    if self.method in ("eagle", "eagle3", "mtp", "medusa") else "")
            raise InvalidArgumentError(f"{_field('method')}={self.method!r} is not supported; "
                                       f"use one of {list(METHODS)}{hint}", _field("method"))
        _positive_int("num_speculative_tokens", self.num_speculative_tokens,
                      MAX_SPECULATIVE_TOKENS)
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidArgumentError(
                f"{_field('prompt_lookup_min')}={self.prompt_lookup_min} is above "
                f"prompt_lookup_max={self.prompt_lookup_max}; use min <= max",
                _field("prompt_lookup_min"))
        a = self.adaptive_min_acceptance
        if not is_number(a) or not 0.0 <= a <= 1.0:
            raise InvalidArgumentError(f"{_field('adaptive_min_acceptance')} must be in [0, 1], "
                                       f"got {a!r}", _field("adaptive_min_acceptance"))
        _positive_int("adaptive_window", self.adaptive_window)
        _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model.strip():
                raise InvalidArgumentError(
                    f"{_field('model')} is required for method 'draft_model': the path (or hub "
                    f"id) of a smaller Qwen sharing the target's tokenizer, got {self.model!r}",
                    _field("model"))
        elif self.model is not None:
            raise InvalidArgumentError(
                f"{_field('model')}={self.model!r} is a draft model, but method is "
                f"{self.method!r}; drop `method` (or use 'draft_model'), or drop `model`",
                _field("model"))
        if self.draft_tensor_parallel_size != 1:
            raise InvalidArgumentError(
                f"{_field('draft_tensor_parallel_size')}={self.draft_tensor_parallel_size!r}: "
                "the draft runs unsharded on rank 0, use 1 (or leave it out)",
                _field("draft_tensor_parallel_size"))

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict or a JSON object string (vLLM's keys) -> config.
        `model` without `method` means a draft model (vLLM's rule); unknown keys are refused
        by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"speculative_config is not valid JSON ({e}); "
                                           'expected e.g. {"method": "ngram", '
                                           '"num_speculative_tokens": 4}',
                                           "speculative_config") from None
        if not isinstance(value, dict):
            raise InvalidArgumentError("speculative_config must be a JSON object (a dict), got "
                                       f"{type(value).__name__}", "speculative_config")
        d = dict(value)
        if d.get("model") is None:
            d.pop("model", None)
        elif "method" not in d:
            d["method"] = "draft_model"
        if "method" not in d:
            raise InvalidArgumentError(f"{_field('method')} is required (use 'ngram', or give "
                                       "a draft checkpoint as `model`)", _field("method"))
        # only a lower bound given above the default upper one: the upper one follows it
        if isinstance(d.get("prompt_lookup_min"), int) and "prompt_lookup_max" not in d:
            d["prompt_lookup_max"] = max(d["prompt_lookup_min"], cls.prompt_lookup_max)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidArgumentError(f"speculative_config: unknown key(s) {unknown}; known: "
                                       f"{sorted(known)}", _field(unknown[0]))
        return cls(**d)

"""Processor: what a user sends -> a frozen EngineRequest, checked once.

Every front end hands its request here: the prompt is checked and tokenized, the sampling
settings, probe spec, interventions and cache salt are checked against the model, and a grammar
is compiled with its first mask tried (engine/guided.py). Every refusal is an
InvalidArgumentError whose `param` names the request field; the engine never re-checks an
EngineRequest. This runs on the caller's thread, so a long prompt's tokenizing or a grammar's
compile never holds the engine's lock.
"""
from __future__ import annotations

import itertools
import random
import secrets
from dataclasses import dataclass, replace

from .errors import InvalidArgumentError, PromptTooLongError
from .probes.spec import ProbeSpec
from .sampling_params import SamplingParams, is_int


@dataclass(frozen=True)
class Prompt:
    """A prompt the processor tokenized: `process` takes it as it is."""
    token_ids: tuple[int, ...]
    text: str | None = None         # a text prompt as given (RequestOutput.prompt)
    rendered: str | None = None     # a conversation as the chat template rendered it

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine runs it: everything checked against the model."""
    request_id: str
    prompt: Prompt
    params: SamplingParams
    seed: int
    watch: ProbeSpec | None = None
    interventions: tuple = ()           # interventions.spec.Intervention, resolved
    cache_root: int | None = None       # the prefix-cache chain's root (engine/cache_salt.py)
    grammar: object | None = None       # guided.Grammar: this request's own matcher
    group: str | None = None            # the API request whose choice this is (n x prompts > 1)
    priority: int = 0                   # vLLM's: lower is scheduled first
    token_filter: object | None = None  # token_filters.TokenFilter: allowed ids, bad words
    salt_tag: int | None = None         # its cache salt's digest: who may read its blocks' text


@dataclass(frozen=True)
class ModelLimits:
    """What the processor checks requests against (fixed while an engine lives)."""
    vocab_size: int
    num_layers: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int


_counter = itertools.count()


def new_request_id(prefix: str) -> str:
    """`prefix-<64 random bits>-<counter>`: unguessable (nobody can take another user's next id
    first), unique in the process; the counter gives sequential requests distinct colours."""
    return f"{prefix}-{secrets.token_hex(8)}-{next(_counter)}"


def is_conversation(prompt) -> bool:
    """A list of chat messages (dicts), as opposed to a list of prompts."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


class Processor:
    def __init__(self, tokenizer, eos_token_ids, limits: ModelLimits, intervention_facts,
                 seed: int = 0):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = limits
        self.intervention_facts = intervention_facts
        self._rng = random.Random(seed)     # seeds of unseeded requests: reproducible per engine

    # ---- prompts ---------------------------------------------------------------------------
    def tokenize(self, prompt, chat_options: dict | None = None) -> Prompt:
        """A string, token ids, or chat messages (rendered with `chat_options`: tools,
        add_generation_prompt, continue_final_message, template variables) -> Prompt; refused
        before tokenizing when it cannot fit. A Prompt is returned as it is."""
        if isinstance(prompt, Prompt):
            return prompt
        from .prompt import check_prompt_chars, check_text
        lim = self.limits
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("this checkpoint has no tokenizer; pass token-id lists",
                                           "prompt")
            check_prompt_chars(len(prompt), lim.max_model_len)     # before tokenizing
            check_text(prompt)
            return self._checked(self.tokenizer.encode(prompt, add_special_tokens=False),
                                 text=prompt)
        if is_conversation(prompt):
            return self._chat(list(prompt), chat_options or {})
        if isinstance(prompt, (list, tuple)):
            if len(prompt) >= lim.max_model_len:        # before checking every id
                raise self.too_long(len(prompt))
            bad = next((t for t in prompt if not is_int(t)), None)
            if bad is not None:
                raise InvalidArgumentError(f"prompt token ids must be integers, got {bad!r} "
                                           f"({type(bad).__name__})", "prompt")
            return self._checked([int(t) for t in prompt])
        raise InvalidArgumentError(f"prompt must be a string, a list of token ids or a list of "
                                   f"chat messages, got {type(prompt).__name__}", "prompt")

    def _chat(self, messages: list, options: dict) -> Prompt:
        from .prompt import (check_no_specials, check_prompt_chars, check_text,
                             conversation_chars, encode_chat)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgumentError("this checkpoint has no chat template; pass a plain "
                                       "prompt", "prompt")
        check_prompt_chars(conversation_chars(messages), self.limits.max_model_len)
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                check_text(m["content"], f"messages[{i}].content")
        check_no_specials(self.tokenizer, "tools", options.get("tools"))
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                check_no_specials(self.tokenizer, f"messages[{i}].tool_calls", m.get("tool_calls"))
        try:
            ids, rendered = encode_chat(self.tokenizer, messages, **options)
        except InvalidArgumentError:
            raise
        except (TypeError, KeyError, ValueError) as e:      # a template variable of a wrong type
            raise InvalidArgumentError(f"the chat template failed with these options: {e}",
                                       "messages") from None
        except Exception as e:      # jinja's TemplateError (raise_exception in a template)
            if type(e).__name__.endswith("TemplateError") or "jinja" in type(e).__module__:
                raise InvalidArgumentError(f"the chat template refused this conversation: {e}",
                                           "messages") from None
            raise
        return self._checked(ids, rendered=rendered)

    def _checked(self, ids: list[int], text: str | None = None,
                 rendered: str | None = None) -> Prompt:
        lim = self.limits
        if not ids:
            raise InvalidArgumentError("prompt is empty: give at least one character or token",
                                       "prompt")
        bad = [t for t in ids if not 0 <= t < lim.vocab_size]
        if bad:
            raise InvalidArgumentError(f"token ids {bad[:5]} are outside the vocabulary "
                                       f"[0, {lim.vocab_size})", "prompt")
        if len(ids) >= lim.max_model_len:
            raise self.too_long(len(ids))
        return Prompt(tuple(ids), text, rendered)

    def too_long(self, n: int) -> PromptTooLongError:
        """The error for a prompt of n tokens that can never fit with one new token."""
        lim = self.limits
        cache_tokens = lim.num_kv_blocks * lim.block_size
        why = (f"the KV cache holds only {cache_tokens} tokens ({lim.num_kv_blocks} blocks "
               f"x {lim.block_size}); raise num_kv_blocks (or gpu_memory_utilization)"
               if lim.max_model_len == cache_tokens else
               f"max_model_len is {lim.max_model_len}; raise max_model_len")
        return PromptTooLongError(f"prompt has {n} tokens and can never fit with at least one "
                                  f"new token: {why}, or shorten the prompt")

    # ---- requests --------------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return new_request_id(prefix)

    def process(self, prompt, sampling: SamplingParams | None = None, *,
                watch: ProbeSpec | None = None, interventions=None,
                cache_salt: str | None = None, request_id: str | None = None,
                chat_options: dict | None = None, group: str | None = None,
                priority: int = 0) -> EngineRequest:
        """The EngineRequest for one prompt (a Prompt from `tokenize`, or anything it takes)."""
        from .cache_salt import chain_root, check_salt, salt_tag
        from .interventions.spec import cache_salt as interventions_salt, resolve_interventions
        params = SamplingParams() if sampling is None else sampling
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"sampling must be a SamplingParams or None, "
                                       f"got {type(params).__name__}", "sampling")
        if watch is not None and not isinstance(watch, ProbeSpec):
            raise InvalidArgumentError(f"watch must be a ProbeSpec or None, got "
                                       f"{type(watch).__name__}", "watch")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidArgumentError(f"request_id must be a non-empty string or None, got "
                                       f"{request_id!r:.80}", "request_id")
        if not is_int(priority) or not -(1 << 31) <= priority < 1 << 31:
            raise InvalidArgumentError(f"priority must be an integer in [-2**31, 2**31), got "
                                       f"{priority!r}", "priority")
        lim = self.limits
        params.check_for_model(lim.vocab_size)
        if watch is not None:                   # negative layers resolved, out of range refused
            watch = watch.resolve(lim.num_layers, lim.vocab_size)
        salt = check_salt(cache_salt)
        ivs = resolve_interventions(interventions, self.intervention_facts)
        p = self.tokenize(prompt, chat_options)
        grammar = None
        if params.guided is not None:           # compiled once, its first mask tried, here
            from .guided import make_matcher
            grammar = make_matcher(self.tokenizer, lim.vocab_size, self.eos_token_ids,
                                   params.guided)
        from .token_filters import token_filter
        filt = token_filter(params, self.tokenizer, lim.vocab_size)
        return EngineRequest(request_id or self.new_request_id(), p, params, self._seed(params),
                             watch, ivs, chain_root(interventions_salt(ivs), salt), grammar,
                             group, int(priority), filt, salt_tag(salt))

    def _seed(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._rng.getrandbits(62)

    def fork(self, req: EngineRequest, request_id: str, params: SamplingParams | None = None,
             watch: ProbeSpec | None = None) -> EngineRequest:
        """Another choice of a checked request (n > 1): its own id, seed and grammar matcher;
        `params` may differ from the request's in their seed only (the rest was checked)."""
        params = params or req.params
        return replace(req, request_id=request_id, params=params, seed=self._seed(params),
                       watch=watch, grammar=req.grammar.copy() if req.grammar is not None
                       else None)

"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

The sampler is vectorised over the batch: per-request settings become tensors, and seeded
randomness comes from a counter-based hash of (seed, position, token id), so a request's
draws do not depend on what else is in the batch and no per-request generator loop is needed.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch

SEED_RANGE = (-(1 << 63), 1 << 63)     # the noise hash takes any int64 seed
MAX_TOP_K = 1 << 31                      # above any vocabulary; top_k >= vocab keeps every token
MAX_LOGPROBS = 20


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _number(name: str, v) -> float:
    if not _is_number(v):
        raise ValueError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return v


def _int(name: str, v, lo: int, hi: int | None, what: str) -> int:
    """v as a Python int in [lo, hi) (hi None: no upper bound), else a ValueError saying `what`."""
    if not _is_int(v) or v < lo or (hi is not None and v >= hi):
        raise ValueError(f"{name} must be {what}, got {v!r}")
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

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)     # the dataclass is frozen
        t = _number("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t!r}")
        put("temperature", t)
        p = _number("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        put("top_p", p)
        m = _number("min_p", self.min_p)
        if not 0.0 <= m <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        put("min_p", m)
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
                                        MAX_LOGPROBS + 1, f"None or an integer in [0, {MAX_LOGPROBS}]"))
        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {v!r}")
            put(name, v)
        r = _number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < r <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100] (1 = off), got {r!r}")
        put("repetition_penalty", r)
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple((int(k), _number("logit_bias value", v)) for k, v in items
                          if _is_int(k) or (isinstance(k, str) and k.lstrip("-").isdigit()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100]: {e}") from None
        if len(pairs) != len(bias) or any(t < 0 or not -100 <= v <= 100 for t, v in pairs):
            raise ValueError(f"logit_bias must map token ids (>= 0) to numbers in [-100, 100], "
                             f"got {bias!r}")
        put("logit_bias", pairs)
        if self.guided is not None:
            from .guided import grammar_of
            put("guided", grammar_of(self.guided))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        put("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), "
                             f"got {ids!r}")
        put("stop_token_ids", tuple(int(i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_for_model(self, vocab_size: int) -> None:
        """The checks that need the model: token ids inside its vocabulary [0, vocab_size)."""
        bad_bias = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary "
                             f"[0, {vocab_size}); give token ids of this model")
        bad = [i for i in self.stop_token_ids if i >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab_size}); give token ids of this model")
        if self.logprobs > vocab_size:
            raise ValueError(f"logprobs={self.logprobs} exceeds the vocabulary size {vocab_size}")


# ---- counter-based uniform noise -----------------------------------------------------------
def _as_signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_C0, _C1, _C2 = (_as_signed(0x9E3779B97F4A7C15), _as_signed(0xBF58476D1CE4E5B9),
                 _as_signed(0x94D049BB133111EB))


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping multiply; logical shifts emulated by masks)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _C1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _C2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (seed, position, token id)."""
    key = _mix64(seeds.to(torch.int64) * _C0 + positions.to(torch.int64))          # [B]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix64(key[:, None] + ids[None, :] * _C0)                               # [B, V]
    # 23 bits: (2**23 - 1) + 0.5 is exact in fp32, so u < 1 strictly. With 24 bits it rounded
    # to 2**24, u == 1.0, E = -log u = 0: that token won whatever its probability (~1 draw in
    # 111 at a 152k vocabulary).
    return (((bits >> 41) & ((1 << 23) - 1)).float() + 0.5) * (1.0 / (1 << 23))


# ---- the sampler ---------------------------------------------------------------------------
@dataclass
class SamplingTensors:
    """Per-row settings for one step, as device tensors."""
    temperature: torch.Tensor   # [B] fp32 (0 = greedy)
    top_k: torch.Tensor         # [B] int64 (0 = off)
    top_p: torch.Tensor         # [B] fp32
    min_p: torch.Tensor         # [B] fp32
    seeds: torch.Tensor         # [B] int64
    positions: torch.Tensor     # [B] int64: index of the token being sampled (for the noise)
    all_greedy: bool
    need_sort: bool             # any top-k / top-p
    need_min_p: bool
    max_logprobs: int
    banned: list[tuple[int, int]]   # (row, token) pairs masked for min_tokens
    penalties: object = None        # penalties.PenaltyTensors, None when no row uses one
    grammar_mask: torch.Tensor | None = None    # [B, ceil(V/32)] int32 allowed-token bits

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
              banned: list[tuple[int, int]], device) -> "SamplingTensors":
        from .step_inputs import SamplingBatch
        return cls.from_batch(SamplingBatch.build(params, seeds, positions, banned), device)

    @classmethod
    def from_batch(cls, b, device, prev_sampled: torch.Tensor | None = None) -> "SamplingTensors":
        """A step_inputs.SamplingBatch (host lists) -> tensors on `device`. `prev_sampled`: the
        previous step's sampled ids on the device (a penalised row's newest token)."""
        f32 = dict(dtype=torch.float32, device="cpu")
        temps = b.temperature
        t = cls(temperature=torch.tensor(temps, **f32),
                top_k=torch.tensor(b.top_k, dtype=torch.int64),
                top_p=torch.tensor(b.top_p, **f32), min_p=torch.tensor(b.min_p, **f32),
                seeds=torch.tensor(b.seeds, dtype=torch.int64),
                positions=torch.tensor(b.positions, dtype=torch.int64),
                all_greedy=all(x == 0.0 for x in temps),
                need_sort=any(k > 0 for k in b.top_k) or any(p < 1.0 for p in b.top_p),
                need_min_p=any(m > 0 for m in b.min_p), max_logprobs=b.max_logprobs,
                banned=b.banned)
        if getattr(b, "grammar_mask", None) is not None:
            nb = torch.device(device).type == "cuda"
            m = torch.from_numpy(b.grammar_mask)
            t.grammar_mask = (m.pin_memory() if nb else m).to(device, non_blocking=nb)
        if getattr(b, "penalties", None) is not None:
            from .penalties import PenaltyTensors
            t.penalties = PenaltyTensors.from_batch(b.penalties, device, prev_sampled)
        if t.all_greedy:        # argmax needs none of the per-row tensors: skip the copies
            return t
        nb = torch.device(device).type == "cuda"
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions"):
            v = getattr(t, name)
            setattr(t, name, (v.pin_memory() if nb else v).to(device, non_blocking=nb))
        return t


def apply_filters(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p exclude. probs: [B, V] fp32."""
    if t.need_min_p:
        pmax = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < t.min_p[:, None] * pmax, 0.0)
    if t.need_sort:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        cut = (t.top_k[:, None] > 0) & (rank >= t.top_k[:, None])
        # keep the smallest prefix whose mass reaches top_p (the token that crosses is kept)
        cum_before = sorted_p.cumsum(dim=-1) - sorted_p
        cut |= cum_before >= t.top_p[:, None] * sorted_p.sum(-1, keepdim=True) - 1e-7
        cut[:, 0] = False
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


def sample(logits: torch.Tensor, t: SamplingTensors):
    """logits [B, V] -> (token ids [B] int64, logprobs [B] fp32, top ids [B,k], top lps [B,k]).
    The logprob outputs are None when no request in the batch asked for logprobs."""
    logits = logits.float()
    if t.penalties is not None:     # before min_tokens' -inf: a penalty must not revive a ban
        from .penalties import apply_penalties
        logits = apply_penalties(logits, t.penalties)
    if t.grammar_mask is not None:  # structured output: tokens the grammar forbids are -inf
        from .guided import apply_bitmask
        logits = apply_bitmask(logits, t.grammar_mask)
    if t.banned:
        rows, toks = zip(*t.banned)
        # a copy: fp32 logits from the runner are inference tensors and must not be written
        logits = logits.clone()
        logits[list(rows), list(toks)] = float("-inf")
    if t.all_greedy:
        tokens = logits.argmax(dim=-1)
    elif logits.is_cuda and not t.need_sort and not t.need_min_p:
        # plain temperature (greedy rows mixed in): one fused pass, the same draw as below up to
        # rounding, instead of softmax and ~20 [B, V] int64 passes for the noise
        from engine.kernels.sampling_kernel import gumbel_argmax
        tokens = gumbel_argmax(logits, t.temperature, t.seeds, t.positions)
    else:
        temp = t.temperature.clamp_min(1e-6)[:, None]
        probs = torch.softmax(logits / temp, dim=-1)
        probs = apply_filters(probs, t)
        # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i
        e = -torch.log(uniform_noise(t.seeds, t.positions, logits.shape[-1]))
        sampled = (probs / e).argmax(dim=-1)
        tokens = torch.where(t.temperature == 0, logits.argmax(dim=-1), sampled)
    if not t.max_logprobs:          # nobody asked: no log-softmax over the vocabulary
        return tokens, None, None, None
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_lp = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    top_lp, top_ids = logprobs.topk(t.max_logprobs, dim=-1)
    return tokens, chosen_lp, top_ids, top_lp

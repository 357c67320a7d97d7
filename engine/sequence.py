"""Per-request state: token ids, KV block table, progress through prefill, outputs."""
from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field

from .probes.spec import ProbeSpec
from .sampling_params import SamplingParams
from .stop_strings import compile_stops


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: dict[int, float]          # top-k token id -> logprob (k = SamplingParams.logprobs)
    rank: int | None = None        # 1 + how many tokens were more likely (prompt logprobs)


class Sequence:
    """One request. Prompt and output tokens share `token_ids`; `num_computed_tokens` of them
    have K/V in the cache. A preempted sequence drops its blocks and recomputes them."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, watch: ProbeSpec | None = None):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # stop ids as a set built once per request (not per step: 10^6 ids made every step slow);
        # the stop-string automaton built here too, off the engine thread (it is cached)
        self.stop_token_set: frozenset[int] = frozenset(params.stop_token_ids)
        self.banned_ids: tuple[int, ...] | None = None  # masked before min_tokens (engine_core)
        if params.stop:
            compile_stops(tuple(params.stop))
        self.seed = seed
        self.watch = watch
        # interventions.spec.Intervention tuple (resolved by the processor), and the root of
        # this request's prefix-cache chain: an intervened prefix is never shared with others
        self.interventions: tuple = ()
        self.cache_salt: int | None = None
        self.group = None           # the request this choice belongs to (scheduler fairness)
        self.priority = 0           # vLLM's: lower is served first
        self.salt_tag = None        # its cache salt's digest (engine/cache_salt.salt_tag)
        self.status = SequenceStatus.WAITING
        # position -> (step id, sampled row) of output tokens still on the device: with overlap
        # scheduling a token is appended as PENDING when its step is launched, and resolved
        # when that step is postprocessed. Always the tail of token_ids (at most two).
        self.pending: dict[int, tuple[int, int]] = {}
        self.block_table: list[int] = []
        self.spec = None            # spec_decode.SpecState when this request speculates
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache (last admit)
        self.prefix_cached_blocks = 0       # total blocks reused from the prefix cache
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.grammar = None         # guided decoding: the request's llguidance matcher
        self.token_filter = None    # token_filters.TokenFilter: allowed ids, bad words
        self.num_masked_steps = 0   # steps whose token the grammar constrained
        self.annotation = ""        # a short note from the API for the playground (LLM.annotate)
        self.resid_capture = None   # steering vectors: the prompt's summed resid_post, fp64
        # SamplingParams.prompt_logprobs: one entry per prompt token (the first has none),
        # filled by position as the prefill computes them (a recompute overwrites)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.output_text = ""
        self.num_preemptions = 0
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None  # left the waiting queue the first time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.token_gaps = array("d")    # seconds between consecutive output tokens (ITL)
        self.finish_time: float | None = None

    @classmethod
    def from_request(cls, req) -> "Sequence":
        """The engine's state for a processed request (engine/processor.EngineRequest)."""
        seq = cls(req.request_id, list(req.prompt.token_ids), req.params, req.seed, req.watch)
        seq.interventions, seq.cache_salt, seq.grammar = (req.interventions, req.cache_root,
                                                          req.grammar)
        seq.group, seq.priority, seq.salt_tag = req.group, req.priority, req.salt_tag
        seq.token_filter = req.token_filter
        return seq

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_resolved_tokens(self) -> int:
        """Tokens whose ids are known on the host (all but the pending tail)."""
        return min(self.pending) if self.pending else len(self.token_ids)

    def pending_src(self, pos: int, step_id: int) -> int:
        """The sampled row of `step_id` that holds the pending token at `pos`."""
        step, row = self.pending[pos]
        if step != step_id:
            raise RuntimeError(f"{self.request_id}: token {pos} is pending from step {step}, "
                               f"not from the step in flight ({step_id})")
        return row

    def drop_pending(self) -> None:
        """Forget unresolved tokens and drafts (the request finished before they came back)."""
        if self.spec is not None and self.spec.drafts:    # a verify scheduled or in flight
            del self.token_ids[self.spec.position:]
            self.spec.drafts = []
        elif self.pending:
            del self.token_ids[min(self.pending):]
        self.pending.clear()

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def metrics(self) -> dict:
        now = self.finish_time or time.perf_counter()
        ttft = (self.first_token_time - self.arrival_time) if self.first_token_time else None
        n = self.num_output_tokens
        decode_s = (now - self.first_token_time) if self.first_token_time else 0.0
        sched = self.first_scheduled_time
        return {"ttft_s": ttft, "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": n,
                "tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                "prefix_cached_blocks": self.prefix_cached_blocks,
                "preemptions": self.num_preemptions,
                "e2e_s": now - self.arrival_time, "decode_s": decode_s,
                # vLLM's request phases: waiting, then scheduled -> first token, then decode
                "queue_s": sched - self.arrival_time if sched is not None else None,
                "prefill_s": (self.first_token_time - sched
                              if sched is not None and self.first_token_time else None),
                "inter_token_s": self.token_gaps,
                **({"spec_decode": self.spec.summary()} if self.spec is not None else {})}


@dataclass
class RequestOutput:
    """What generate() returns per prompt."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # speculative decoding: every verify of this request (spec_decode.DraftVerdict), in order
    drafts: list = field(default_factory=list)


@dataclass
class TokenEvent:
    """One streamed token (or the final event of a request)."""
    request_id: str
    token_id: int | None
    text: str                      # new text since the previous event
    output_text: str               # whole reply so far (stop strings never included)
    finished: bool = False
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None
    metrics: dict | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # on a request's first event
    # on the final event of a request that captured its prompt's resid_post (steering vectors):
    # the sum over its prompt tokens, fp64 [hidden]
    resid_capture: object = None
    # speculative decoding: on the first token of a verify, its spec_decode.DraftVerdict (what
    # was drafted from this token's position on, how many were accepted, the target's token)
    draft: object = None

"""Speculative decoding: a cheap proposer guesses the next k tokens, the target model verifies
all of them in one forward (k + 1 query rows), and the step keeps the accepted prefix plus one
token of the target's own. The output is the target's: token for token under greedy, and in
distribution (and, for n-gram drafts, token for token under a seed) when sampling.

config.py     SpeculativeConfig (vLLM's --speculative-config JSON), validated
ngram.py      prompt lookup: propose the continuation of the last n-gram's latest earlier match
draft_model.py  a smaller Qwen's greedy drafts, from its own paged KV cache, batched per step
draft_sampling.py  the draft's rows: greedy under the request's masks, bans, bias, penalties
rejection.py  the verify rule: greedy, sampled with a draft distribution q, and one-hot q
state.py      per-request speculation state (drafts in flight, adaptive back-off, the log)
"""
from .config import SpeculativeConfig
from .ngram import propose_ngram
from .rejection import num_accepted, rejection_sample
from .state import DraftVerdict, SpecState, SpecStats

__all__ = ["SpeculativeConfig", "propose_ngram", "num_accepted", "rejection_sample",
           "DraftVerdict", "SpecState", "SpecStats"]

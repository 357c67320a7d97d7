"""Speculative decoding: a cheap proposer (n-gram prompt lookup, or a smaller draft model)
guesses the next k tokens, the target verifies all of them in one forward (k + 1 query rows),
and the step keeps the accepted prefix plus one token of the target's own. The output is the
target's: token for token under greedy, and in distribution (for n-gram drafts, token for
token under a seed) when sampling.
"""
from .config import SpeculativeConfig
from .ngram import propose_ngram
from .rejection import num_accepted, rejection_sample
from .state import DraftVerdict, SpecState, SpecStats

__all__ = ["SpeculativeConfig", "propose_ngram", "num_accepted", "rejection_sample",
           "DraftVerdict", "SpecState", "SpecStats"]

"""Prompt lookup (n-gram) proposer: no weights. The last n tokens (n from prompt_lookup_max down
to prompt_lookup_min) are looked up in the prompt and output so far; the tokens that followed
their most recent earlier occurrence are the draft. Copy-heavy replies (code edits, quoting,
summaries of the prompt) repeat long spans, and those spans are accepted whole."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens continuing `token_ids` (prompt + output so far), or [] when no
    n-gram of the tail occurs earlier. O(len * n) numpy work per call, no Python loop over
    positions."""
    ids = np.asarray(token_ids, dtype=np.int64)
    L = len(ids)
    if k < 1 or L < 2:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = ids[L - n:]
        # windows starting at 0 .. L-n-1: every earlier occurrence (the tail itself excluded)
        win = sliding_window_view(ids[:L - 1], n)          # [L - n, n]
        hits = np.flatnonzero((win == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n                       # the most recent match's continuation
            return ids[start:start + k].tolist()
    return []

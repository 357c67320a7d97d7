"""Per-request speculation state: the drafts in flight, the adaptive back-off, and the log of
every verify (what was drafted, how much the target accepted, the token it chose instead) that
the request's output and the chat read."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .config import SpeculativeConfig
from .ngram import propose_ngram


@dataclass(frozen=True)
class DraftVerdict:
    """One verify of one request: drafts proposed for token positions position.. and the first
    `num_accepted` of them kept; `token` is the target's own token after them (the correction
    at the first rejected position, or the bonus token when every draft was accepted)."""
    position: int                   # index in the request's token ids of the first draft
    drafted: tuple[int, ...]
    num_accepted: int
    token: int
    # optional: a proposer with a distribution (a draft model) may give its own top guesses
    # at each drafted position, [len(drafted)][k] ids and probabilities, for the Layers tab's
    # side-by-side view; None for n-gram lookup (one proposed token, no distribution)
    draft_top_ids: tuple | None = None
    draft_top_probs: tuple | None = None

    @property
    def rejected(self) -> tuple[int, ...]:
        return self.drafted[self.num_accepted:]


class SpecState:
    """One request's speculation: k drafts per step while its acceptance stays high enough."""

    def __init__(self, config: SpeculativeConfig, k: int, proposer=None):
        self.config = config
        # (token_ids, k) -> up to k drafts; None: n-gram prompt lookup. A draft model's
        # (spec_decode/draft_model.DraftSeq) also takes each verdict (`on_verdict`: roll its
        # cache back) and `release` (return its cache blocks); bench/spec_decode.py plugs in
        # an oracle that replays a plain run
        self.proposer = proposer
        self.k = k
        self.active = k > 0
        self.drafts: list[int] = []     # in flight: token_ids[position:position + len] hold them
        self.position = 0
        self._window: deque[tuple[int, int]] = deque(maxlen=config.adaptive_window)
        self.log: list[DraftVerdict] = []
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # the request's tokens as int64, grown in place: at a proposal token_ids holds no draft
        # and only ever grew since the last one, so only the new tail is copied (not O(length))
        self._ids = np.zeros(0, np.int64)
        self._n = 0

    def _token_array(self, token_ids) -> np.ndarray:
        n = len(token_ids)
        if n > len(self._ids):
            grown = np.zeros(max(2 * len(self._ids), n + 64), np.int64)
            grown[:self._n] = self._ids[:self._n]
            self._ids = grown
        if n > self._n:
            self._ids[self._n:n] = token_ids[self._n:n]
        self._n = n
        return self._ids[:n]

    def propose(self, token_ids, limit: int) -> list[int]:
        """Up to min(k, limit) drafts continuing token_ids (none when inactive)."""
        k = min(self.k, limit)
        if not self.active or k < 1:
            return []
        if self.proposer is not None:
            return list(self.proposer(token_ids, k))[:k]
        c = self.config
        return propose_ngram(self._token_array(token_ids), k, c.prompt_lookup_min,
                             c.prompt_lookup_max)

    def record(self, verdict: DraftVerdict) -> None:
        """Count one verify; back off for good when the recent acceptance rate is too low."""
        on_verdict = getattr(self.proposer, "on_verdict", None)
        if on_verdict is not None:
            on_verdict(verdict)
        self.log.append(verdict)
        n = len(verdict.drafted)
        self.num_drafts += 1
        self.num_draft_tokens += n
        self.num_accepted_tokens += verdict.num_accepted
        self._window.append((n, verdict.num_accepted))
        # judged from min(8, window) proposals on: a request with nothing to find stops paying
        # for verifies after a few steps, not after a whole window of them
        if len(self._window) >= min(8, self._window.maxlen):
            drafted = sum(d for d, _ in self._window)
            accepted = sum(a for _, a in self._window)
            if accepted < self.config.adaptive_min_acceptance * drafted:
                self.active = False
                self.release()

    def release(self) -> None:
        """The request finished, was preempted or stopped speculating: a proposer with state
        (a draft model's cache) lets it go."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release()

    def summary(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "speculating": self.active}


class SpecStats:
    """Engine-wide counters (vLLM's vllm:spec_decode_* metrics): drafts (verifies with at least
    one draft), draft tokens, accepted tokens, and accepted tokens per draft position."""

    def __init__(self):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def add(self, verdict: DraftVerdict) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += len(verdict.drafted)
        self.num_accepted_tokens += verdict.num_accepted
        per = self.accepted_per_pos
        if len(per) < len(verdict.drafted):
            per.extend([0] * (len(verdict.drafted) - len(per)))
        for i in range(verdict.num_accepted):
            per[i] += 1

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}

"""Per-request speculation state: the drafts in flight, the adaptive back-off, and the log of
every verify (what was drafted, how much the target accepted, the token it chose instead) that
the request's output and the chat read."""
from __future__ import annotations

import math
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


# with overlap scheduling, a request whose proposer found nothing this many times in a row rests
# (no proposals, so no drained step: overlap goes on) for REST_FIRST tokens, twice as long each
# time after (without overlap a lookup that finds nothing costs microseconds: no rest)
EMPTY_BEFORE_REST = 4
REST_FIRST, REST_MAX = 8, 256
# the back-off stops a request only when its acceptance is below the bar beyond this many
# standard errors (one-sided 95 %): a 50 % acceptance is not stopped by a bad first window
Z_BACKOFF = 1.645


class SpecState:
    """One request's speculation: k drafts per step while its acceptance stays high enough."""

    def __init__(self, config: SpeculativeConfig, k: int, proposer=None,
                 rest_when_empty: bool = True):
        self.config = config
        self.rest_when_empty = rest_when_empty
        # (token_ids, k) -> up to k drafts; None: n-gram prompt lookup. A draft model's
        # (spec_decode/draft_model.DraftSeq) also takes each verdict (`on_verdict`: roll its
        # cache back) and `release` (return its cache blocks); bench/spec_decode.py plugs in
        # an oracle that replays a plain run
        self.proposer = proposer
        self.k = k
        self.active = k > 0
        self.drafts: list[int] = []     # in flight: token_ids[position:position + len] hold them
        self.position = 0
        # (draft slots offered, drafts accepted) of the last proposals
        self._window: deque[tuple[int, int]] = deque(maxlen=config.adaptive_window)
        self._offered = 0               # slots of the proposal in flight: min(k, limit)
        self.log: list[DraftVerdict] = []
        self.stats = SpecStats()
        # the request's tokens as int64, grown in place: at a proposal token_ids holds no draft
        # and only ever grew since the last one, so only the new tail is copied (not O(length))
        self._ids = np.zeros(0, np.int64)
        self._n = 0
        self.rest_until = 0             # no proposals before the request holds this many tokens
        self._empty = 0                 # proposals in a row that found nothing
        self._rest = REST_FIRST

    def speculating_at(self, num_tokens: int) -> bool:
        """Active, and not resting after proposals that found nothing."""
        return self.active and num_tokens >= self.rest_until

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
        self._offered = k
        if self.proposer is not None:
            drafts = list(self.proposer(token_ids, k))[:k]
        else:
            c = self.config
            drafts = propose_ngram(self._token_array(token_ids), k, c.prompt_lookup_min,
                                   c.prompt_lookup_max)
        self._after_proposal(len(token_ids), bool(drafts))
        return drafts

    def _after_proposal(self, num_tokens: int, found: bool) -> None:
        """Nothing to find costs a drained step each time (the newest token must reach the
        host before a lookup): after a few empty proposals, rest, longer each time."""
        if found or not self.rest_when_empty:
            self._empty, self._rest = 0, REST_FIRST
            return
        self._empty += 1
        if self._empty >= EMPTY_BEFORE_REST:
            self.rest_until = num_tokens + self._rest
            self._rest = min(2 * self._rest, REST_MAX)
            self._empty = 0

    def record(self, verdict: DraftVerdict) -> None:
        """Count one verify; back off for good when the recent acceptance rate is too low."""
        on_verdict = getattr(self.proposer, "on_verdict", None)
        if on_verdict is not None:
            on_verdict(verdict)
        self.log.append(verdict)
        self.stats.add(verdict)
        self._window.append((max(self._offered, len(verdict.drafted)), verdict.num_accepted))
        if self._below_break_even():
            self.active = False
            self.release()

    def _below_break_even(self) -> bool:
        """A verify costs about the same whatever its number of drafts (one forward over 1 + k
        rows, no overlap), so it pays when it emits enough tokens: the bar is
        adaptive_min_acceptance of the draft slots offered (empty slots count as rejected).
        Judged from min(8, window) proposals on, and only when the window's mean is below the
        bar by Z_BACKOFF standard errors, so noise does not stop a good request."""
        w = self._window
        n = len(w)
        if n < min(8, w.maxlen):
            return False
        acc = [a for _, a in w]
        mean = sum(acc) / n
        var = sum((a - mean) ** 2 for a in acc) / (n - 1)
        slots = sum(k for k, _ in w) / n     # k, fewer where max_tokens or the budget cut it
        return mean + Z_BACKOFF * math.sqrt(var / n) < self.config.adaptive_min_acceptance * slots

    def release(self) -> None:
        """The request finished, was preempted or stopped speculating: a proposer with state
        (a draft model's cache) lets it go."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release()

    def summary(self) -> dict:
        st = self.stats
        return {"num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                "num_accepted_tokens": st.num_accepted_tokens, "speculating": self.active}


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

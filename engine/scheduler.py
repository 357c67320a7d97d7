"""Token-budget continuous batching: running requests first (decodes and the next chunk of
unfinished prefills), then waiting ones while the budget and max_num_seqs allow, by priority
(vLLM's: lower first), then arrival. When the cache runs out the youngest running request of
the lowest priority is preempted (its blocks freed; recomputed later, nothing lost).

Fairness: a request's choices (its `group`: the n copies and prompts of one API call; None for
a single choice) may hold at most `max_group_share` of the KV cache while another request
waits: past it, the group's waiting choices wait and its running ones are preempted first, so
one caller's n=64 cannot evict everyone else. Alone, a group may use it all.

Speculative decoding (engine/spec_decode): a request with drafts feeds its newest token and the
drafts as one chunk; draft blocks are taken only when free (drafts never preempt anyone), and
such entries go last, so every plain row keeps its index. on_result keeps the accepted drafts
and the target's token one at a time (stop rules after each), then frees the rejected ones'
blocks.

Overlap scheduling: a token sampled by the step in flight is already in the sequence as
PENDING (appended by `on_launch`), so lengths, blocks, min_tokens and max_tokens are exact;
`on_result` fills it in one step later and applies the stop rules that need its value (a
request that stops then has one wasted decode row in flight)."""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus
from .spec_decode.rejection import num_accepted
from .spec_decode.state import DraftVerdict, SpecStats
from .step_inputs import PENDING


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int             # tokens computed this step (a prefill chunk, or 1 to decode)
    start: int                  # position of the first of them
    # speculative decoding: draft tokens fed after the newest token (num_tokens = 1 + num_draft);
    # every one of the 1 + num_draft rows is sampled, to verify the drafts (spec_decode/)
    num_draft: int = 0
    # this chunk reaches the end of the sequence, so its last logits are sampled (fixed when
    # scheduled: the sampled token is appended later in the step)
    samples: bool = field(init=False)

    def __post_init__(self):
        self.samples = self.start + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: set[int],
                 max_group_share: float = 0.5):
        self.bm = block_manager
        self.max_group_blocks = max(1, int(max_group_share * block_manager.num_blocks))
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.spec_stats = SpecStats()        # speculative decoding's counters (vLLM's metrics)
        self.t_propose = 0.0                 # seconds proposing drafts in the last schedule()

    def add(self, seq: Sequence) -> None:
        if self.waiting and seq.priority < self.waiting[-1].priority:
            # before the first request of a lower priority (a larger number): FIFO within one
            i = next(i for i, w in enumerate(self.waiting) if w.priority > seq.priority)
            self.waiting.insert(i, seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)

    # ---- scheduling ------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.spec is not None:
            if seq.spec.drafts:             # scheduled with drafts this very step
                del seq.token_ids[seq.spec.position:]
                seq.spec.drafts = []
            seq.spec.release()              # a draft model's cache mirrors the target's
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _group_blocks(self) -> dict:
        held: dict = {}
        for seq in self.running:
            if seq.group is not None:
                held[seq.group] = held.get(seq.group, 0) + len(seq.block_table)
        return held

    def _contended(self, group) -> bool:
        """Another request's choices wait, or run, beside this group's."""
        return any(s.group != group for s in itertools.chain(self.waiting, self.running))

    def _victim(self) -> Sequence:
        """Whom to preempt: the youngest running choice of a group past its share of the cache
        while others are served, else the youngest of the lowest priority."""
        held = self._group_blocks()
        over = [s for s in self.running if held.get(s.group, 0) >= self.max_group_blocks
                and self._contended(s.group)]
        pool = over or self.running
        worst = max(s.priority for s in pool)
        return next(s for s in reversed(pool) if s.priority == worst)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        drafted = False
        self.t_propose = 0.0
        # 1. running requests, oldest first; make room by preempting (see _victim)
        i, bs = 0, self.bm.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            length = len(seq.token_ids)
            if seq.pending and self._reached_limit(seq):
                i += 1                               # its last token is in flight: it is done
                continue
            if self.may_draft(seq):
                k = self._draft(seq, length, budget)
                if k:
                    out.append(ScheduledSeq(seq, 1 + k, length - 1, k))
                    budget -= 1 + k
                    drafted = True
                    i += 1
                    continue
            if (length + bs - 1) // bs > len(seq.block_table):   # needs a new block (1 step in bs)
                while not self.bm.can_append(seq, length):
                    victim = self._victim()
                    if self.running.index(victim) < i:
                        i -= 1                       # an earlier entry left: seq moved down
                        out = [o for o in out if o.seq is not victim]
                        budget = self.max_num_batched_tokens - sum(o.num_tokens for o in out)
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    continue                         # seq preempted itself
                self.bm.append_slots(seq, length)
            n = min(length - seq.num_computed_tokens, budget)
            out.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
            i += 1
        # 2. admit waiting requests (preempted ones are at the front); a group past its share
        # of the cache waits while another request's choices are served
        held = self._group_blocks()
        skipped: set = set()
        k = 0
        while k < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[k]
            if seq.group is not None and (seq.group in skipped or (
                    held.get(seq.group, 0) >= self.max_group_blocks
                    and self._contended(seq.group))):
                skipped.add(seq.group)
                k += 1
                continue
            if seq.pending or not self.bm.can_allocate(seq):   # pending: preempted in flight
                break
            del self.waiting[k]
            self.bm.allocate(seq)
            if seq.group is not None:
                held[seq.group] = held.get(seq.group, 0) + len(seq.block_table)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:    # vLLM's queue time ends here
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            out.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
        if drafted:     # verify entries last: the plain rows keep their indices
            out = [o for o in out if not o.num_draft] + [o for o in out if o.num_draft]
        return out

    def speculates_now(self, seq: Sequence) -> bool:
        """seq speculates (active, not resting after empty proposals), and no more requests run
        than its config's disable_by_batch_size."""
        return seq.spec is not None and seq.spec.speculating_at(len(seq.token_ids)) and \
            len(self.running) <= seq.spec.config.disable_by_batch_size

    def may_draft(self, seq: Sequence) -> bool:
        """A request speculating now whose every token but the newest has its K/V: it may
        verify drafts this step (a draft model's prefetch asks too, to batch its proposals)."""
        return self.speculates_now(seq) and not seq.pending and \
            seq.num_computed_tokens == len(seq.token_ids) - 1

    def draft_limit(self, seq: Sequence, budget: int) -> int:
        """How many drafts seq may take after its own token: what max_tokens, max_model_len and
        the budget leave room for (< 1: none)."""
        return min(seq.params.max_tokens - seq.num_output_tokens,
                   self.max_model_len - len(seq.token_ids), budget) - 1

    def _draft(self, seq: Sequence, length: int, budget: int) -> int:
        """Propose, append the drafts to seq and take their blocks: how many (0: none fit, or
        nothing to propose)."""
        limit = self.draft_limit(seq, budget)
        if limit < 1:
            return 0
        t0 = time.perf_counter()
        drafts = seq.spec.propose(seq.token_ids, limit)
        self.t_propose += time.perf_counter() - t0
        if not drafts or not self.bm.can_append(seq, length + len(drafts)):
            return 0
        self.bm.append_slots(seq, length + len(drafts))
        seq.token_ids.extend(drafts)
        seq.spec.drafts, seq.spec.position = drafts, length
        return len(drafts)

    def _reached_limit(self, seq: Sequence) -> bool:
        return seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len

    # ---- around the forward ----------------------------------------------------------------
    def on_launch(self, scheduled: list[ScheduledSeq], step_id: int) -> None:
        """The step is on the device: its tokens count as computed, and each sampling row's
        token is appended as PENDING (resolved by on_result)."""
        k = 0
        for s in scheduled:
            seq = s.seq
            # drafts are not computed tokens until they are accepted
            seq.num_computed_tokens = s.start + s.num_tokens - s.num_draft
            if s.samples:
                seq.pending[len(seq.token_ids)] = (step_id, k)
                seq.token_ids.append(PENDING)
                k += 1 + s.num_draft

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.drop_pending()
        if seq.spec is not None:
            seq.spec.release()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def on_result(self, scheduled: list[ScheduledSeq], tokens: list[int], step_id: int
                  ) -> Iterator[tuple[Sequence, int]]:
        """Resolve the step's sampled tokens (one per sampling row, in order) and apply the
        stop rules. Yields (sequence, token) for each token a live sequence received; a
        verify entry yields its tokens one by one, and stops early once the caller (a stop
        string found in the text) or a stop rule has finished the sequence."""
        k = 0
        for s in scheduled:
            seq = s.seq
            if not s.samples:
                if not seq.is_finished:
                    self.bm.commit(seq)
                continue
            tok = tokens[k]
            k += 1 + s.num_draft
            if seq.is_finished:                  # aborted or stopped while in flight
                continue
            if s.num_draft:
                yield from self._verify(seq, tokens[k - 1 - s.num_draft:k])
                continue
            pos = next((p for p, src in seq.pending.items() if src == (step_id, k - 1)), None)
            if pos is None:
                continue
            del seq.pending[pos]
            seq.token_ids[pos] = tok
            self.bm.commit(seq)
            self._stop_rules(seq, pos, tok)
            yield seq, tok

    def _stop_rules(self, seq: Sequence, pos: int, tok: int) -> None:
        p = seq.params
        n_out = pos + 1 - seq.num_prompt_tokens
        if (not p.ignore_eos and tok in self.eos_token_ids and n_out >= p.min_tokens) or \
                (tok in seq.stop_token_set and n_out >= p.min_tokens):
            del seq.token_ids[pos + 1:]      # a later token may already be in flight
            self.finish(seq, "stop")
        elif n_out >= p.max_tokens or pos + 1 >= self.max_model_len:
            del seq.token_ids[pos + 1:]
            self.finish(seq, "length")

    def _verify(self, seq: Sequence, sampled: list[int]) -> Iterator[tuple[Sequence, int]]:
        """A verify entry's result: the target's tokens at the 1 + k positions (sampled with
        the request's own settings and noise). Drafts are kept while they equal them, then the
        target's token; rollback: the drafts leave token_ids, and blocks that only rejected
        drafts needed are freed (never hashed: commit sees accepted tokens only)."""
        spec = seq.spec
        drafts, start = spec.drafts, spec.position
        a = num_accepted(sampled, drafts)
        emitted = sampled[:a + 1]
        spec.drafts = []
        del seq.pending[start + len(drafts)]
        del seq.token_ids[start:]
        self.bm.truncate(seq, start + a)     # the blocks the kept K/V (positions < start + a) use
        guesses = getattr(spec.proposer, "last_guesses", None)     # a draft model's, watched
        verdict = DraftVerdict(start, tuple(drafts), a, emitted[-1], *(guesses or (None, None)))
        spec.record(verdict)
        self.spec_stats.add(verdict)
        for tok in emitted:
            pos = len(seq.token_ids)
            seq.token_ids.append(tok)
            seq.num_computed_tokens = pos      # every token before the newest has its K/V
            self.bm.commit(seq)
            self._stop_rules(seq, pos, tok)
            yield seq, tok
            if seq.is_finished:
                return

    def postprocess(self, scheduled: list[ScheduledSeq], tokens: list[int]) -> list[Sequence]:
        """Serial form (tests, tools): on_launch and on_result of one step at once."""
        self.on_launch(scheduled, -1)
        return [seq for seq, _ in self.on_result(scheduled, tokens, -1)]

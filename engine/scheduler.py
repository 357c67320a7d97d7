"""Token-budget continuous batching: running requests first (decode tokens and the next chunk
of unfinished prefills), then new requests while the budget and max_num_seqs allow, in order of
priority (vLLM's: lower first), then arrival. When the cache runs out a running request is
preempted (its blocks freed; it is recomputed later, with nothing lost): the youngest of the
lowest priority.

Fairness: a request's choices (its `group`: the n copies and prompt batch of one API call;
None for a request of one choice, which is never held back) may hold at most `max_group_share` of the KV cache while another request waits: past it, that
group's waiting choices are not admitted and its running ones are preempted first, so one
caller's n=64 cannot fill the cache and preempt everyone else. Alone, a group may use it all.

With overlap scheduling the batch of step N+1 is chosen while step N runs: a token sampled by
step N is already in the sequence as PENDING (appended by `on_launch`), so lengths, block
allocation, min_tokens and max_tokens are exact; `on_result` fills it in one step later and
applies the stop rules that need its value (EOS, stop ids). A request that stops then has one
wasted decode row in flight, whose blocks are freed with the rest of its blocks."""
from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus
from .step_inputs import PENDING


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int             # tokens computed this step (a prefill chunk, or 1 to decode)
    start: int                  # position of the first of them
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
        return any(s.group != group for s in self.waiting) or \
            any(s.group != group for s in self.running)

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
        # 1. running requests, oldest first; make room by preempting (see _victim)
        i, bs = 0, self.bm.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            length = len(seq.token_ids)
            if seq.pending and self._reached_limit(seq):
                i += 1                               # its last token is in flight: it is done
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
            if seq.group is not None and seq.group in skipped:
                k += 1
                continue
            if seq.group is not None and held.get(seq.group, 0) >= self.max_group_blocks \
                    and self._contended(seq.group):
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
        return out

    def _reached_limit(self, seq: Sequence) -> bool:
        return seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len

    # ---- around the forward ----------------------------------------------------------------
    def on_launch(self, scheduled: list[ScheduledSeq], step_id: int) -> None:
        """The step is on the device: its tokens count as computed, and each sampling row's
        token is appended as PENDING (resolved by on_result)."""
        k = 0
        for s in scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_tokens
            if s.samples:
                seq.pending[len(seq.token_ids)] = (step_id, k)
                seq.token_ids.append(PENDING)
                k += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.drop_pending()
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.free(seq)

    def on_result(self, scheduled: list[ScheduledSeq], tokens: list[int], step_id: int
                  ) -> list[tuple[Sequence, int]]:
        """Resolve the step's sampled tokens (one per sampling entry, in order) and apply the
        stop rules. Returns (sequence, token) for each live sequence that received one."""
        got, k = [], 0
        for s in scheduled:
            seq = s.seq
            if not s.samples:
                if not seq.is_finished:
                    self.bm.commit(seq)
                continue
            tok = tokens[k]
            k += 1
            if seq.is_finished:                  # aborted or stopped while in flight
                continue
            pos = next((p for p, src in seq.pending.items() if src == (step_id, k - 1)), None)
            if pos is None:
                continue
            del seq.pending[pos]
            seq.token_ids[pos] = tok
            self.bm.commit(seq)
            got.append((seq, tok))
            p = seq.params
            n_out = pos + 1 - seq.num_prompt_tokens
            if (not p.ignore_eos and tok in self.eos_token_ids and n_out >= p.min_tokens) or \
                    (tok in seq.stop_token_set and n_out >= p.min_tokens):
                del seq.token_ids[pos + 1:]      # a later token may already be in flight
                self.finish(seq, "stop")
            elif n_out >= p.max_tokens or pos + 1 >= self.max_model_len:
                del seq.token_ids[pos + 1:]
                self.finish(seq, "length")
        return got

    def postprocess(self, scheduled: list[ScheduledSeq], tokens: list[int]) -> list[Sequence]:
        """Serial form (tests, tools): on_launch and on_result of one step at once."""
        self.on_launch(scheduled, -1)
        return [seq for seq, _ in self.on_result(scheduled, tokens, -1)]

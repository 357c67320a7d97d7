"""Token-budget continuous batching: running requests first (decode tokens and the next chunk
of unfinished prefills), then new requests while the budget and max_num_seqs allow. When the
cache runs out, the youngest running request is preempted (its blocks freed; it is recomputed
later, with nothing lost).

With overlap scheduling the batch of step N+1 is chosen while step N runs: a token sampled by
step N is already in the sequence as PENDING (appended by `on_launch`), so lengths, block
allocation, min_tokens and max_tokens are exact; `on_result` fills it in one step later and
applies the stop rules that need its value (EOS, stop ids). A request that stops then has one
wasted decode row in flight, whose blocks are freed with the rest of its blocks."""
from __future__ import annotations

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
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: set[int]):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
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

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        # 1. running requests, oldest first; make room by preempting the youngest
        i, bs = 0, self.bm.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            length = len(seq.token_ids)
            if seq.pending and self._reached_limit(seq):
                i += 1                               # its last token is in flight: it is done
                continue
            if (length + bs - 1) // bs > len(seq.block_table):   # needs a new block (1 step in bs)
                while not self.bm.can_append(seq, length):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break                            # seq preempted itself: nothing left after it
                self.bm.append_slots(seq, length)
            n = min(length - seq.num_computed_tokens, budget)
            out.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
            i += 1
        # 2. admit waiting requests (preempted ones are at the front)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.pending or not self.bm.can_allocate(seq):   # pending: preempted in flight
                break
            self.waiting.popleft()
            self.bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
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

"""Rank 0's bookkeeping for the penalties' device count rows (engine/penalties.py): which row
each penalised request owns and how many of its output tokens that row has counted, so a step
sends only the tokens added since the request's previous step (O(batch) host work a step).

Invariant: for a request with a row, `counts[slot]` holds the counts of its first `counted`
output tokens and `prompt_seen[slot]` its prompt's tokens (when it has a repetition penalty).
Output tokens are only ever appended while a request runs (a preempted request keeps them and
recomputes their K/V; tokens are dropped only when it finishes), so the invariant survives
preemption. A launch that fails may or may not have applied its additions: `invalidate` makes
the next step rebuild those rows from the host's token ids.
"""
from __future__ import annotations

import numpy as np

from .penalties import PenaltyBatch, needs_counts
from .step_inputs import PENDING

_I64 = np.int64


class PenaltySlots:
    def __init__(self):
        self._slot: dict = {}           # Sequence -> its count row
        self._counted: dict = {}        # Sequence -> output tokens in that row (absent: clear it)
        self._free: list[int] = []
        self._size = 0                  # rows handed out so far (the device holds at least these)
        self._scratch: list[int] = []   # rows for speculative verify rows (rebuilt every step)

    def _take(self, seq) -> int:
        if not self._free:              # reclaim the rows of finished requests before growing
            for s in [s for s in self._slot if s.is_finished]:
                self._free.append(self._slot.pop(s))
                self._counted.pop(s, None)
        if not self._free:
            self._free.append(self._size)
            self._size += 1
        slot = self._free.pop()
        self._slot[seq] = slot
        return slot

    def invalidate(self, seqs) -> None:
        """These requests' rows may be out of step (a failed launch): rebuild them when next
        sampled."""
        for seq in seqs:
            self._counted.pop(seq, None)

    def slot_of(self, seq) -> int | None:
        return self._slot.get(seq)

    def _scratch_slot(self, i: int) -> int:
        while len(self._scratch) <= i:
            self._scratch.append(self._size)
            self._size += 1
        return self._scratch[i]

    def batch(self, seqs, prev_step_id: int) -> PenaltyBatch:
        """seqs: the step's sampled rows' Sequences, in row order (a speculating request's
        1 + k verify rows: it, 1 + k times in a row)."""
        rows, slots, pres, freq, rep = [], [], [], [], []
        reset, seen_s, seen_t, add_s, add_t, pend_s, pend_src = [], [], [], [], [], [], []
        b_r, b_t, b_v = [], [], []
        copy_s, copy_d, draft_s, draft_t = [], [], [], []
        first_row: dict = {}            # a verify's first row, by request
        for row, seq in enumerate(seqs):
            p = seq.params
            for tok, bias in p.logit_bias:
                b_r.append(row)
                b_t.append(tok)
                b_v.append(bias)
            if not needs_counts(p):
                continue
            spec = getattr(seq, "spec", None)      # (test doubles of Sequence may lack it)
            drafts = spec.drafts if spec is not None else ()
            if drafts and seq in first_row:     # verify row j > 0: its row + drafts[:j]
                j = row - first_row[seq]
                slot = self._scratch_slot(len(copy_d))
                copy_s.append(self._slot[seq])
                copy_d.append(slot)
                draft_s += [slot] * j
                draft_t += drafts[:j]
            else:
                first_row[seq] = row
                slot = self._slot[seq] if seq in self._slot else self._take(seq)
                counted = self._counted.get(seq)
                if counted is None:         # a fresh row (or one to rebuild): clear, then recount
                    counted = 0
                    reset.append(slot)
                    if p.repetition_penalty != 1.0:
                        prompt = np.unique(np.asarray(seq.prompt_token_ids, dtype=_I64))
                        seen_s.append(np.full(len(prompt), slot, dtype=_I64))
                        seen_t.append(prompt)
                start = seq.num_prompt_tokens + counted
                # the drafts in token_ids are not output (yet): verify rows count them on scratch
                end = spec.position if drafts else len(seq.token_ids)
                for pos in range(start, end):
                    tok = seq.token_ids[pos]
                    if tok == PENDING:      # sampled by the step in flight: read on the device
                        pend_s.append(slot)
                        pend_src.append(seq.pending_src(pos, prev_step_id))
                    else:
                        add_s.append(slot)
                        add_t.append(tok)
                self._counted[seq] = end - seq.num_prompt_tokens
            rows.append(row)
            slots.append(slot)
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            rep.append(p.repetition_penalty)
        i64 = lambda xs: np.array(xs, dtype=_I64)                       # noqa: E731
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, _I64)  # noqa: E731
        f32 = lambda xs: np.array(xs, dtype=np.float32)                  # noqa: E731
        return PenaltyBatch(
            rows=i64(rows), slots=i64(slots), presence=f32(pres), frequency=f32(freq),
            repetition=f32(rep), num_slots=self._size if rows else 0, reset_slots=i64(reset),
            seen_slots=cat(seen_s), seen_tokens=cat(seen_t), add_slots=i64(add_s),
            add_tokens=i64(add_t), pending_slots=i64(pend_s), pending_src=i64(pend_src),
            bias_rows=i64(b_r), bias_tokens=i64(b_t), bias_values=f32(b_v),
            copy_src=i64(copy_s), copy_dst=i64(copy_d), draft_slots=i64(draft_s),
            draft_tokens=i64(draft_t))

"""StepInputs: one scheduled batch flattened into the host arrays every rank's forward needs
(built on rank 0, sent by value to the other ranks, staged onto each device there).

A row whose input token was sampled by the step still in flight (overlap scheduling) has no id
on the host yet: `pending_rows` / `pending_src` take it from that step's sampled ids, which
every rank keeps on its device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cascade import plan_cascade

PENDING = -1        # a token id in Sequence.token_ids that the device has not returned yet


@dataclass
class SamplingBatch:
    """Per sampled row settings, host side (SamplingTensors.from_batch puts them on a device)."""
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]
    positions: list[int]        # index of the token being sampled (for the seeded noise)
    banned: list[tuple[int, int]]   # (row, token id) masked for min_tokens
    max_logprobs: int
    penalties: object = None        # penalties.PenaltyBatch when some row uses one
    grammar_mask: np.ndarray | None = None  # [S, ceil(V/32)] int32 when some row is guided
    # or, a guided row's newest token still in flight: grammar_masks.LateMask, which the runner
    # calls after launching the forward (one process only: it does not cross to TP workers)
    grammar_mask_fn: object = None

    @classmethod
    def build(cls, params, seeds, positions, banned) -> "SamplingBatch":
        return cls([p.temperature for p in params], [p.top_k for p in params],
                   [p.top_p for p in params], [p.min_p for p in params], list(seeds),
                   list(positions), list(banned), max((p.logprobs for p in params), default=0))

    def __len__(self) -> int:
        return len(self.seeds)


@dataclass
class StepInputs:
    """One step's batch as host arrays: what rank 0 sends to every rank."""
    step_id: int
    input_ids: np.ndarray           # [N] int64 (PENDING where pending_rows point)
    positions: np.ndarray           # [N] int64
    slot_mapping: np.ndarray        # [N] int64
    context_lens: np.ndarray        # [B] int32
    block_tables: np.ndarray        # [B, max_blocks] int32
    cu_seqlens_q: np.ndarray        # [B + 1] int32
    max_seqlen_q: int
    sample_rows: np.ndarray         # [S] int64: flat rows whose logits are sampled
    is_decode: bool
    sampling: SamplingBatch | None  # None when no row samples
    pending_rows: np.ndarray        # [P] int64 flat rows whose input id is still on the device
    pending_src: np.ndarray         # [P] int64 their index in the previous step's sampled ids
    prev_step_id: int = -1          # the step those sampled ids came from
    probe_plan: object | None = None   # probes.plan.ProbePlan, or None when nothing is watched
    interventions: object | None = None   # interventions.plan.InterventionPlan, or None (none)
    # prompt logprobs (SamplingParams.prompt_logprobs): flat rows whose logits give the logprob
    # of the prompt token after them, those tokens, and the largest top-k asked; None when no
    # request in the step asked (see prompt_logprob_rows for the order)
    prompt_lp_rows: np.ndarray | None = None      # [R] int64
    prompt_lp_targets: np.ndarray | None = None   # [R] int64
    prompt_lp_k: int = 0
    cascade: object | None = None   # cascade.CascadePlan: decode rows sharing prefix blocks

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def prompt_logprob_rows(scheduled):
    """(flat row, sequence, position of the prompt token it predicts) for every prompt token
    this step computes the logprob of: a prefill chunk's row at position j gives token j + 1."""
    total = 0
    for s in scheduled:
        seq = s.seq
        if seq.params.prompt_logprobs is not None:
            for j in range(s.start, min(s.start + s.num_tokens, seq.num_prompt_tokens - 1)):
                yield total + j - s.start, seq, j + 1
        total += s.num_tokens


def build_step_inputs(step_id: int, scheduled, block_size: int, sampling: SamplingBatch | None,
                      probe_plan=None, prev_step_id: int = -1,
                      cascade_min_saved: int = 0) -> StepInputs:
    """Flatten a scheduled batch. Plain Python lists and one numpy block table: this runs on
    every step, serial with the host side of the step, so per-row tensor work is avoided."""
    ids, pos, slots, ctx_lens, cu, rows = [], [], [], [], [0], []
    pend_rows, pend_src = [], []
    max_q = max((s.num_tokens for s in scheduled), default=0)
    max_blocks = max((len(s.seq.block_table) for s in scheduled), default=1) or 1
    table = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
    total = 0
    for i, s in enumerate(scheduled):
        seq, n, start = s.seq, s.num_tokens, s.start
        bt = seq.block_table
        table[i, :len(bt)] = bt
        if n == 1:                                   # decode: no per-token ranges
            tok = seq.token_ids[start]
            if tok == PENDING:
                pend_rows.append(total)
                pend_src.append(seq.pending_src(start, prev_step_id))
            ids.append(tok)
            pos.append(start)
            slots.append(bt[start // block_size] * block_size + start % block_size)
        else:
            ids.extend(seq.token_ids[start:start + n])
            p = range(start, start + n)
            pos.extend(p)
            slots.extend(bt[j // block_size] * block_size + j % block_size for j in p)
        ctx_lens.append(start + n)
        total += n
        cu.append(total)
        if s.samples:
            if s.num_draft:                          # a verify: every row of the chunk samples
                rows.extend(range(total - 1 - s.num_draft, total))
            else:
                rows.append(total - 1)
    ctx = np.array(ctx_lens, dtype=np.int32)
    lp_rows = lp_targets = None
    lp_k = 0
    found = list(prompt_logprob_rows(scheduled))
    if found:
        lp_rows = np.array([r for r, _, _ in found], dtype=np.int64)
        lp_targets = np.array([seq.token_ids[p] for _, seq, p in found], dtype=np.int64)
        lp_k = max(seq.params.prompt_logprobs for _, seq, _ in found)
    return StepInputs(
        prompt_lp_rows=lp_rows, prompt_lp_targets=lp_targets, prompt_lp_k=lp_k,
        step_id=step_id, input_ids=np.array(ids, dtype=np.int64),
        positions=np.array(pos, dtype=np.int64), slot_mapping=np.array(slots, dtype=np.int64),
        context_lens=ctx, block_tables=table,
        cu_seqlens_q=np.array(cu, dtype=np.int32), max_seqlen_q=max_q,
        sample_rows=np.array(rows, dtype=np.int64), is_decode=max_q == 1, sampling=sampling,
        pending_rows=np.array(pend_rows, dtype=np.int64),
        pending_src=np.array(pend_src, dtype=np.int64), prev_step_id=prev_step_id,
        probe_plan=probe_plan,
        cascade=plan_cascade(table, ctx, block_size, cascade_min_saved) if max_q == 1 else None)

"""The draft model's sampling rows: greedy, with everything that can change a greedy choice
applied as the target applies it, so the draft proposes what the target would keep.

- structured output: row masked by the request's grammar advanced through the drafts so far
  (spec_decode/grammar.DraftedGrammar, rolled back after), ANDed with allowed_token_ids;
- min_tokens: EOS and the stop ids banned before the request's min_tokens-th output token;
- logit_bias and presence / frequency / repetition penalties: a PenaltyBatch rebuilt whole for
  each round (counts = the output so far plus the drafts before the row; the draft's runner has
  no persistent count rows to keep in step, and penalised requests are rare);
- top-k / top-p / min-p / temperature / seed: none moves the argmax, so none is needed.
"""
from __future__ import annotations

import numpy as np

from ..penalties import PenaltyBatch, needs_counts
from ..step_inputs import SamplingBatch
from .grammar import DraftedGrammar

DRAFT_TOP_K = 5     # the draft's top guesses kept per drafted position of a watched request


def draft_batch(rows, eos_token_ids, masks) -> SamplingBatch:
    """The greedy SamplingBatch of the draft's sampled rows (DraftSeq, each at its newest fed
    token: the row drafts token index len(row.token_ids))."""
    n = len(rows)
    banned, grammars, allowed = [], [], []
    for r, st in enumerate(rows):
        seq, p = st.seq, st.seq.params
        if len(st.token_ids) - seq.num_prompt_tokens < p.min_tokens:
            stops = seq.stop_token_set | (frozenset() if p.ignore_eos else eos_token_ids)
            banned.extend((r, t) for t in stops)
        drafted = st.token_ids[len(seq.token_ids):]
        grammars.append(DraftedGrammar(seq.grammar, drafted) if seq.grammar is not None
                        else None)
        f = seq.token_filter
        allowed.append(f.allowed if f is not None else None)
    # a watched request's drafts carry the draft's top guesses (the Layers tab shows them
    # beside the target's at a rejection): logprobs only when one is watched
    top = DRAFT_TOP_K if any(st.seq.watch is not None for st in rows) else 0
    batch = SamplingBatch([0.0] * n, [0] * n, [1.0] * n, [0.0] * n, [0] * n,
                          [len(st.token_ids) for st in rows], banned, top)
    if any(g is not None for g in grammars) or any(a is not None for a in allowed):
        batch.grammar_mask = masks.fill(grammars, allowed)
    if any(st.seq.params.uses_penalties for st in rows):
        batch.penalties = _penalties(rows)
    return batch


def is_legal(batch: SamplingBatch | None, row: int, tok: int) -> bool:
    """The greedy token is allowed by its row's mask and bans (it is not when every token of
    the row was masked: argmax then returns an arbitrary one)."""
    if batch is None:
        return True
    m = batch.grammar_mask
    if m is not None and not (int(m[row, tok >> 5]) & 0xFFFFFFFF) >> (tok & 31) & 1:
        return False
    return (row, tok) not in batch.banned if batch.banned else True


def _penalties(rows) -> PenaltyBatch:
    """Every penalised row's counts from scratch in a count slot of its own (slot i of the
    i-th such row), and every logit_bias entry."""
    i64 = np.int64
    prow, pres, freq, rep = [], [], [], []
    seen_s, seen_t, add_s, add_t = [], [], [], []
    b_rows, b_tok, b_val = [], [], []
    for r, st in enumerate(rows):
        p, npr = st.seq.params, st.seq.num_prompt_tokens
        for tok, bias in p.logit_bias:
            b_rows.append(r)
            b_tok.append(tok)
            b_val.append(bias)
        if not needs_counts(p):
            continue
        slot = len(prow)
        prow.append(r)
        pres.append(p.presence_penalty)
        freq.append(p.frequency_penalty)
        rep.append(p.repetition_penalty)
        out = st.token_ids[npr:]                # the output so far and the drafts before
        add_s += [slot] * len(out)
        add_t += out
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(st.token_ids[:npr], dtype=i64))
            seen_s += [slot] * len(seen)
            seen_t += seen.tolist()
    f32 = np.float32

    def a(x, t=i64) -> np.ndarray:
        return np.asarray(x, dtype=t)
    return PenaltyBatch(
        rows=a(prow), slots=a(range(len(prow))), presence=a(pres, f32),
        frequency=a(freq, f32), repetition=a(rep, f32), num_slots=len(prow),
        reset_slots=a(range(len(prow))), seen_slots=a(seen_s), seen_tokens=a(seen_t),
        add_slots=a(add_s), add_tokens=a(add_t), pending_slots=a([]), pending_src=a([]),
        bias_rows=a(b_rows), bias_tokens=a(b_tok), bias_values=a(b_val, f32))

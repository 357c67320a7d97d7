"""Presence, frequency and repetition penalties and logit_bias, applied to a step's logits from
per-row device tensors (no host sync, no per-row Python on the device side).

Definitions (the references the tests compare against):
- repetition_penalty (HF's RepetitionPenaltyLogitsProcessor, vLLM's): for every token in the
  prompt or the output so far, a positive logit is divided by it, a negative one multiplied;
- frequency_penalty / presence_penalty (OpenAI's): logit -= frequency * count + presence *
  (count > 0), counts over the output tokens only;
- logit_bias (OpenAI's): added to the token's logit, before the penalties (vLLM's order).

The host side (`PenaltyBatch.build`) lists the rows' token ids once per step; a token still on
the device (overlap scheduling: the previous step's sample) is named by its index in that step's
sampled ids and read there. Steps where no row uses any of this skip it entirely.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PENDING = -1


@dataclass
class PenaltyBatch:
    """Host lists for one step's sampled rows (only built when some row uses a penalty)."""
    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    out_rows: np.ndarray        # [T] int64: (row, token) of each known output token
    out_tokens: np.ndarray
    prompt_rows: np.ndarray     # [Q] int64: (row, token) of each distinct prompt token
    prompt_tokens: np.ndarray
    pending_rows: np.ndarray    # [P] int64: rows whose newest output token is on the device
    pending_src: np.ndarray     # [P] int64: its index in the previous step's sampled ids
    bias_rows: np.ndarray       # [K] int64: logit_bias entries
    bias_tokens: np.ndarray
    bias_values: np.ndarray     # [K] fp32

    @staticmethod
    def needed(params) -> bool:
        return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                or params.repetition_penalty != 1.0 or bool(params.logit_bias))

    @classmethod
    def build(cls, seqs, prev_step_id: int) -> "PenaltyBatch":
        """seqs: the step's sampled rows' Sequences, in row order."""
        out_r, out_t, pr_r, pr_t, pend_r, pend_s, b_r, b_t, b_v = ([] for _ in range(9))
        for row, seq in enumerate(seqs):
            p = seq.params
            for tok, bias in p.logit_bias:
                b_r.append(row)
                b_t.append(tok)
                b_v.append(bias)
            if p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and \
                    p.repetition_penalty == 1.0:
                continue
            out = np.asarray(seq.token_ids[seq.num_prompt_tokens:], dtype=np.int64)
            known = out[out != PENDING]
            out_r.append(np.full(len(known), row, dtype=np.int64))
            out_t.append(known)
            for pos in seq.pending:
                pend_r.append(row)
                pend_s.append(seq.pending_src(pos, prev_step_id))
            if p.repetition_penalty != 1.0:
                prompt = np.unique(np.asarray(seq.prompt_token_ids, dtype=np.int64))
                pr_r.append(np.full(len(prompt), row, dtype=np.int64))
                pr_t.append(prompt)
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
        return cls([s.params.presence_penalty for s in seqs],
                   [s.params.frequency_penalty for s in seqs],
                   [s.params.repetition_penalty for s in seqs], cat(out_r), cat(out_t),
                   cat(pr_r), cat(pr_t), np.array(pend_r, dtype=np.int64),
                   np.array(pend_s, dtype=np.int64), np.array(b_r, dtype=np.int64),
                   np.array(b_t, dtype=np.int64), np.array(b_v, dtype=np.float32))


@dataclass
class PenaltyTensors:
    presence: torch.Tensor      # [B] fp32
    frequency: torch.Tensor     # [B] fp32
    repetition: torch.Tensor    # [B] fp32
    out_rows: torch.Tensor
    out_tokens: torch.Tensor    # the previous step's pending samples appended
    prompt_rows: torch.Tensor
    prompt_tokens: torch.Tensor
    bias_rows: torch.Tensor
    bias_tokens: torch.Tensor
    bias_values: torch.Tensor
    any_counts: bool            # a presence / frequency / repetition penalty in some row

    @classmethod
    def from_batch(cls, b: PenaltyBatch, device, prev_sampled: torch.Tensor | None
                   ) -> "PenaltyTensors":
        nb = torch.device(device).type == "cuda"

        def dev(a, dtype=None):
            t = torch.as_tensor(a, dtype=dtype)
            return (t.pin_memory() if nb else t).to(device, non_blocking=nb)
        rows, toks = dev(b.out_rows), dev(b.out_tokens)
        if len(b.pending_rows):
            if prev_sampled is None:
                raise RuntimeError("a penalised row's newest token is on the device, but the "
                                   "previous step's sampled ids are not")
            rows = torch.cat([rows, dev(b.pending_rows)])
            toks = torch.cat([toks, prev_sampled.index_select(0, dev(b.pending_src))])
        f32 = torch.float32
        return cls(dev(b.presence, f32), dev(b.frequency, f32), dev(b.repetition, f32), rows,
                   toks, dev(b.prompt_rows), dev(b.prompt_tokens), dev(b.bias_rows),
                   dev(b.bias_tokens), dev(b.bias_values),
                   any(x != 0.0 for x in b.presence) or any(x != 0.0 for x in b.frequency)
                   or any(x != 1.0 for x in b.repetition))


def apply_penalties(logits: torch.Tensor, t: PenaltyTensors) -> torch.Tensor:
    """logits [B, V] fp32 -> a penalised copy."""
    logits = logits.clone()
    if len(t.bias_rows):
        logits.index_put_((t.bias_rows, t.bias_tokens), t.bias_values, accumulate=True)
    if not t.any_counts:
        return logits
    counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    counts.index_put_((t.out_rows, t.out_tokens),
                      torch.ones(len(t.out_rows), device=logits.device), accumulate=True)
    in_output = counts > 0
    seen = in_output.clone()
    if len(t.prompt_rows):
        seen[t.prompt_rows, t.prompt_tokens] = True
    rep = t.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency[:, None] * counts - t.presence[:, None] * in_output.float()

"""Prompt logprobs from the prefill: for the rows of the requests that asked (and only those),
the LM head's logits, log_softmax, the next prompt token's logprob and rank, and the top-k.
Computed in slices of rows so a long prompt never holds [prompt_len, vocab] logits at once."""
from __future__ import annotations

import torch

ROWS_PER_SLICE = 512


def prompt_logprobs(compute_logits, hidden: torch.Tensor, rows: torch.Tensor,
                    targets: torch.Tensor, k: int):
    """hidden [N, H]; rows, targets [R] int64 on hidden's device.
    -> (chosen [R] fp32, rank [R] int64, top ids [R, k] int64, top logprobs [R, k] fp32)."""
    chosen, ranks, top_ids, top_lps = [], [], [], []
    for i in range(0, len(rows), ROWS_PER_SLICE):
        h = hidden.index_select(0, rows[i:i + ROWS_PER_SLICE])
        lp = torch.log_softmax(compute_logits(h).float(), dim=-1)       # [r, vocab]
        c = lp.gather(-1, targets[i:i + ROWS_PER_SLICE, None])          # [r, 1]
        chosen.append(c.squeeze(-1))
        ranks.append((lp > c).sum(-1) + 1)
        if k:
            v, ids = lp.topk(k, dim=-1)
            top_ids.append(ids)
            top_lps.append(v)
    if not k:
        empty = torch.empty(len(rows), 0, device=hidden.device)
        return torch.cat(chosen), torch.cat(ranks), empty.long(), empty
    return torch.cat(chosen), torch.cat(ranks), torch.cat(top_ids), torch.cat(top_lps)

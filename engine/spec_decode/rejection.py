"""The verify rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

Given the target's distributions p_0..p_k at the k + 1 verified positions and k draft tokens
x_i drawn from the draft's q_i: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection emit a token from the residual norm(max(0, p_i - q_i)) and stop; when all k are
accepted emit a bonus token from p_k. Every emitted token is then distributed exactly as the
target alone would have sampled it.

For a deterministic proposer (n-gram) q_i is one-hot on x_i: acceptance is p_i(x_i) and the
residual is p_i with x_i removed. Drawing t_i ~ p_i and accepting while t_i == x_i is the same
law (P(accept) = p_i(x_i); given a rejection, t_i ~ p_i conditioned on t_i != x_i), and it lets
the engine draw t_i with the very sampler and noise (seed, position) plain decoding uses: a
seeded request speculates to the same tokens it would decode. That is `num_accepted`; the
general rule is `rejection_sample` (a draft model's verify), both tested by χ² in
tests/test_spec_decode.py.
"""
from __future__ import annotations

import torch


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """One-hot q (and greedy, where t_i is the argmax): drafts accepted while they equal the
    target's own token at their position. sampled: [k + 1] target tokens, drafts: [k]."""
    a = 0
    for t, d in zip(sampled, drafts):
        if t != d:
            break
        a += 1
    return a


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> tuple[int, list[int]]:
    """target_probs [k + 1, V] (after temperature and top-k/top-p/min-p, rows sum to 1),
    draft_tokens [k] int64, draft_probs [k, V] (None: one-hot on the drafts). Returns (number
    of drafts accepted a, the emitted tokens: the a accepted drafts then one token from the
    residual, or the bonus token from p_k). `generator` seeds every draw."""
    k = draft_tokens.shape[0]
    p = target_probs.double()
    out: list[int] = []
    for i in range(k):
        x = int(draft_tokens[i])
        px = p[i, x]
        if draft_probs is None:
            q_row = torch.zeros_like(p[i])
            q_row[x] = 1.0
        else:
            q_row = draft_probs[i].double()
        qx = q_row[x]
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if qx > 0 and u < torch.clamp(px / qx, max=1.0):
            out.append(x)
            continue
        residual = torch.clamp(p[i] - q_row, min=0.0)
        s = residual.sum()
        # p == q on the support (accepted surely): never reached with probability > 0
        residual = residual / s if s > 0 else p[i]
        out.append(int(torch.multinomial(residual.float(), 1, generator=generator)))
        return i, out
    out.append(int(torch.multinomial(p[k].float(), 1, generator=generator)))
    return k, out

"""The logit lens' statistics of each row of lens logits: its top-k tokens and their
probabilities, its entropy and its log-sum-exp, in two launches that read the logits once, with
no [rows, vocab] softmax in memory (28 x 151,936 bf16, k = 10, one H100: 272.6 us for the torch
sequence, 43.4 us here; bench/RESULTS.md, 2026-12-06 morning).

A program reads one chunk of a row: its maximum, its sums of exp(x - max) and of
exp(x - max) * (x - max), and its k largest logits; a second launch merges each row's chunks.
Entropy from chunk partials: with p = exp(x - M) / S, H = log S - (1/S) sum exp(x - M) (x - M),
and a chunk's sums at its own max m move to M as sum exp(x - M)(x - M) = exp(m - M)(t + (m - M) s).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 32          # the top-k loop is unrolled k times; larger k take the torch path
BLOCK_V = 4096      # vocabulary per program: 38 chunks of a 151,936-token row


@triton.jit
def _chunk_kernel(logits_ptr, stride_row, m_ptr, s_ptr, t_ptr, top_v_ptr, top_i_ptr,
                  vocab, num_chunks, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ids = chunk * BLOCK + offs
    valid = ids < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=valid,
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    d = tl.where(valid, x - m, 0.0)
    e = tl.where(valid, tl.exp(d), 0.0)
    slot = row * num_chunks + chunk
    tl.store(m_ptr + slot, m)
    tl.store(s_ptr + slot, tl.sum(e, axis=0))
    tl.store(t_ptr + slot, tl.sum(e * d, axis=0))
    # the chunk's k largest, largest first; ties go to the lowest id (as the merge's)
    v = x
    for j in tl.static_range(K):
        best, at = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(top_v_ptr + slot * K + j, best)
        tl.store(top_i_ptr + slot * K + j, chunk * BLOCK + at)
        v = tl.where(offs == at, float("-inf"), v)


@triton.jit
def _merge_kernel(m_ptr, s_ptr, t_ptr, top_v_ptr, top_i_ptr, out_i_ptr, out_f_ptr, num_chunks,
                  K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_KC: tl.constexpr):
    # out_f's row: top_p (K) | entropy | lse
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    cm = c < num_chunks
    mc = tl.load(m_ptr + row * num_chunks + c, mask=cm, other=float("-inf"))
    sc = tl.load(s_ptr + row * num_chunks + c, mask=cm, other=0.0)
    tc = tl.load(t_ptr + row * num_chunks + c, mask=cm, other=0.0)
    big = tl.max(mc, axis=0)
    shift = tl.where(cm, mc - big, 0.0)
    w = tl.where(cm, tl.exp(shift), 0.0)
    s = tl.sum(sc * w, axis=0)
    t = tl.sum(w * (tc + shift * sc), axis=0)
    log_s = tl.log(s)
    f_row = out_f_ptr + row * (K + 2)
    tl.store(f_row + K, log_s - t / s)
    tl.store(f_row + K + 1, big + log_s)
    # candidates in chunk order, each chunk's largest first: the leftmost of equal values is the
    # lowest id
    kc = tl.arange(0, BLOCK_KC)
    km = kc < num_chunks * K
    v = tl.load(top_v_ptr + row * num_chunks * K + kc, mask=km, other=float("-inf"))
    ids = tl.load(top_i_ptr + row * num_chunks * K + kc, mask=km, other=0)
    for j in tl.static_range(K):
        best, at = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(f_row + j, tl.exp(best - big) / s)
        tl.store(out_i_ptr + row * K + j, tl.sum(tl.where(kc == at, ids, 0), axis=0))
        v = tl.where(kc == at, float("-inf"), v)


def lens_stats(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """logits [R, V] (any float dtype) -> top_i [R, k] int32, top_p [R, k], entropy [R] (nats)
    and lse [R] (the log-sum-exp, for `sampled_stats`), all fp32 but the ids. The torch
    reference for k > MAX_K."""
    R, V = logits.shape
    if k > MAX_K or R == 0:
        return lens_stats_ref(logits, k)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    C = triton.cdiv(V, BLOCK_V)
    part = torch.empty(3, R, C, dtype=torch.float32, device=dev)
    top_v = torch.empty(R, C, k, dtype=torch.float32, device=dev)
    top_i = torch.empty(R, C, k, dtype=torch.int32, device=dev)
    _chunk_kernel[(R, C)](logits, logits.stride(0), part[0], part[1], part[2], top_v, top_i, V, C,
                          K=k, BLOCK=BLOCK_V, num_warps=8)
    out_i = torch.empty(R, k, dtype=torch.int32, device=dev)
    out_f = torch.empty(R, k + 2, dtype=torch.float32, device=dev)    # top_p | entropy | lse
    _merge_kernel[(R,)](part[0], part[1], part[2], top_v, top_i, out_i, out_f, C, K=k,
                        BLOCK_C=max(16, triton.next_power_of_2(C)),
                        BLOCK_KC=max(16, triton.next_power_of_2(C * k)), num_warps=4)
    return dict(top_i=out_i, top_p=out_f[:, :k], entropy=out_f[:, k], lse=out_f[:, k + 1])


def lens_stats_ref(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Torch reference (and the engine's CPU path): softmax in fp32, then its top-k and entropy."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    probs = torch.exp(x - lse[:, None])
    top_p, top_i = probs.topk(k, dim=-1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return dict(top_i=top_i.to(torch.int32), top_p=top_p, entropy=entropy, lse=lse)


@triton.jit
def _sampled_kernel(logits_ptr, stride_l, stride_w, lse_ptr, tokens_ptr, out_ptr, W, vocab,
                    rows, BLOCK: tl.constexpr):
    # out: prob [rows] | rank [rows], fp32, zeroed: each chunk adds its count of larger logits
    # (whole numbers: the float sum is exact and independent of the order)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    w = row % W
    base = logits_ptr + (row // W).to(tl.int64) * stride_l + w.to(tl.int64) * stride_w
    x = tl.load(base + tl.load(tokens_ptr + w)).to(tl.float32)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
    tl.atomic_add(out_ptr + rows + row, tl.sum((v > x).to(tl.float32), axis=0))
    if chunk == 0:
        tl.store(out_ptr + row, tl.exp(x - tl.load(lse_ptr + row)))


def sampled_stats(logits: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor):
    """Each lens row's probability of the token the step sampled and its rank (how many tokens
    have a larger logit; 0 = the lens' top guess), both fp32 (they travel in the probes' flat
    buffer): logits [L, W, V], lse [L, W], tokens [W] -> prob [L, W], rank [L, W]. Two launches
    (a zeroed output and one pass over the logits) where torch took six."""
    L, W, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.zeros(2, L, W, dtype=torch.float32, device=logits.device)
    if L * W:
        _sampled_kernel[(L * W, triton.cdiv(V, BLOCK_V))](
            logits, logits.stride(0), logits.stride(1), lse.contiguous(), tokens, out, W, V,
            L * W, BLOCK=BLOCK_V, num_warps=8)
    return out[0], out[1]


def sampled_stats_ref(logits: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor):
    """Torch reference (and the engine's CPU path) of `sampled_stats`."""
    x = logits.gather(-1, tokens[None, :, None].expand(logits.shape[0], -1, 1))     # [L, W, 1]
    prob = torch.exp(x[..., 0].float() - lse)
    rank = (logits > x).sum(-1).float()
    return prob, rank


__all__ = ["lens_stats", "lens_stats_ref", "sampled_stats", "sampled_stats_ref", "MAX_K"]

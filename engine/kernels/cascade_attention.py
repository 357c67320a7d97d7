"""Cascade decode attention: requests that share prefix blocks read them once, not once each.

Prefix caching holds a shared prompt prefix's KV blocks once, but plain decode attention reads
them once per request (256 requests on a 2,048-token prefix: 256 times a step). As vLLM's
cascade attention and FlashInfer's shared-prefix kernels, each row's keys are split in two:

1. the shared prefix: `_prefix_kernel` packs the queries of every row in the group (row x query
   head of one KV head, up to BLOCK_M a program) against the prefix, read through the lead
   row's block table, and writes a partial output and its log2-domain lse into the first split
   slots of decode attention's workspace (lse -inf for a row outside the group).
2. the rest: decode_attention's kernel, each row starting at `first` (0 outside the group),
   whose merge folds the prefix partials in.

Equal to the plain kernel up to the order of additions. What the kernels read about the cascade
is in device tensors, so one captured graph serves every step of a bucket whatever the prefix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .decode_attention import (choose_num_splits, dot_precision, gather_context, num_sms,
                               paged_decode_attention, paged_decode_attention_ref, workspace)
from .pdl import use_pdl, wait_prior

BLOCK_M = 64            # packed (row, query head) pairs per prefix program: one K/V tile each
PREFIX_BLOCK_N = 64
MAX_PREFIX_SPLITS = 16
MIN_PREFIX_SPLIT_TOKENS = 256


@dataclass
class CascadeInputs:
    """A decode step's cascade, as the kernels read it."""
    first: torch.Tensor      # [B] int32: each row's first key past the shared prefix (0: none)
    lead: torch.Tensor       # [1] int32: a row of the group (its table holds the prefix blocks)
    prefix_bound: int        # tokens the prefix may hold at most (the grid is sized by it)


@triton.jit
def _prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, first_ptr, lead_ptr,
    part_out_ptr, part_lse_ptr,
    scale_log2, num_rows, slots,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    lead = tl.load(lead_ptr)
    shared = tl.load(first_ptr + lead)                 # the prefix's tokens (whole blocks)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)         # packed (row, head in group)
    b = r // GROUP
    heads = kvh * GROUP + r % GROUP
    in_rows = r < num_rows * GROUP
    # (a vector condition throughout: the interpreter's masks must not be scalars)
    first_b = tl.load(first_ptr + b, mask=in_rows, other=0)
    grouped = in_rows & (first_b == shared) & (first_b > 0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tiles = tl.cdiv(shared, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, shared)
    wait_prior(USE_PDL)     # q is the previous kernel's output
    q = tl.load(q_ptr + b.to(tl.int64)[:, None] * stride_qb + heads[:, None] * stride_qh
                + d[None, :], mask=grouped[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + lead.to(tl.int64) * stride_bt
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < hi
        block = tl.load(bt_row + t // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        kv_off = block * stride_cb + (t % PAGE_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2    # [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    # a row outside the group, or a split past the prefix: an empty partial (lse -inf)
    lse = tl.where(grouped & (l_i > 0.0), m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)),
                   float("-inf"))
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    slot = (b.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * slots + split
    tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + d[None, :], o,
             mask=in_rows[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + slot, lse, mask=in_rows)


def choose_prefix_splits(batch: int, group: int, num_kv_heads: int, prefix_bound: int,
                         device: torch.device) -> int:
    """Split the prefix's keys when the packed rows alone leave most SMs idle."""
    programs = triton.cdiv(batch * group, BLOCK_M) * num_kv_heads
    want = triton.cdiv(num_sms(device), programs)
    return max(1, min(want, MAX_PREFIX_SPLITS,
                      triton.cdiv(prefix_bound, MIN_PREFIX_SPLIT_TOKENS)))


def cascade_decode_attention(
    q: torch.Tensor,             # [B, Hq, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    cascade: CascadeInputs,
    out: torch.Tensor | None = None,
    max_context: int | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    bound = min(block_tables.shape[1] * page_size, max_context or (1 << 62))
    num_splits = choose_num_splits(batch, num_kv_heads, bound, q.device)
    prefix_splits = choose_prefix_splits(batch, group, num_kv_heads, cascade.prefix_bound,
                                         q.device)
    slots = prefix_splits + num_splits
    part_out, part_lse, _ = workspace(q.device, batch, num_q_heads, num_kv_heads, head_dim, slots)
    use = use_pdl(q, pdl)
    _prefix_kernel[(triton.cdiv(batch * group, BLOCK_M), num_kv_heads, prefix_splits)](
        q, k_cache, v_cache, block_tables, cascade.first, cascade.lead, part_out, part_lse,
        scale * math.log2(math.e), batch, slots,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=PREFIX_BLOCK_N, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE_SIZE=page_size,
        DOT_PREC=dot_precision(q.dtype), USE_PDL=use, num_warps=4, num_stages=2,
        launch_pdl=use)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                                  num_splits=num_splits, max_context=max_context, pdl=pdl,
                                  first=cascade.first, prefix_slots=prefix_splits)


def cascade_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, first: torch.Tensor, lead: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch cascade (the reference, and the engine's CPU path): the group's queries against
    the prefix once, each row against its own keys, the two merged by their log-sum-exps."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    shared = int(first[lead])
    grouped = (first == shared) & (shared > 0)
    if out is None:
        out = torch.empty_like(q)
    if not bool(grouped.any()):
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          out)
    kp = gather_context(k_cache, block_tables[lead:lead + 1], shared)[0].transpose(0, 1).float()
    vp = gather_context(v_cache, block_tables[lead:lead + 1], shared)[0].transpose(0, 1).float()
    rows = grouped.nonzero().flatten()
    qg = q[rows].float().transpose(0, 1)                            # [Hq, G, D]
    g = num_q_heads // num_kv_heads
    s = torch.einsum("hgd,hpd->hgp", qg, kp.repeat_interleave(g, 0)) * scale
    lse_p = torch.logsumexp(s, -1)                                  # [Hq, G]
    o_p = torch.einsum("hgp,hpd->hgd", s.softmax(-1), vp.repeat_interleave(g, 0))
    rest = torch.zeros_like(q, dtype=torch.float32)
    lse_r = torch.full((batch, num_q_heads), float("-inf"), device=q.device)
    for b in range(batch):
        lo, hi = int(first[b]), int(context_lens[b])
        if hi <= lo:
            continue
        k = gather_context(k_cache, block_tables[b:b + 1], hi)[0, lo:].transpose(0, 1).float()
        v = gather_context(v_cache, block_tables[b:b + 1], hi)[0, lo:].transpose(0, 1).float()
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        sb = torch.einsum("hd,hpd->hp", q[b].float(), k) * scale
        lse_r[b] = torch.logsumexp(sb, -1)
        rest[b] = torch.einsum("hp,hpd->hd", sb.softmax(-1), v)
    res = rest.clone()
    lp, lr = lse_p.transpose(0, 1), lse_r[rows]                     # [G, Hq]
    m = torch.maximum(lp, lr)
    wp, wr = torch.exp(lp - m), torch.exp(lr - m)
    res[rows] = (wp[..., None] * o_p.transpose(0, 1) + wr[..., None] * rest[rows]) / \
        (wp + wr)[..., None]
    out.copy_(res)
    return out


__all__ = ["CascadeInputs", "cascade_decode_attention", "cascade_decode_attention_ref"]

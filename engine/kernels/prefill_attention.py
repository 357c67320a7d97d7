"""Paged prefill attention: packed variable-length query chunks attend causally to their paged KV.

Everything is read through the block tables (the chunk's own K/V were stored first), so one
kernel covers a plain prefill, a chunked prefill and a prefix-cache hit alike: query j of a
chunk of q_len tokens sits at absolute position context_len - q_len + j.

Grid: (query tile, sequence, kv_head x split). A tile packs BLOCK_M (query, head) rows of one
KV head's group, so each K/V tile is loaded once for the group. When the launch is too small to
fill the GPU (a short chunk after a long prefix) the KV range is split too, and merged by
decode_attention's combine kernel.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.decode_attention import (check_paged_inputs, combine_splits, dot_precision,
                                             gather_context, num_sms)
from engine.kernels.jit_keys import varying

MAX_SPLITS = 16
SPLIT_MAX_TOKENS = 512  # above this many query tokens the grid fills the GPU anyway
# Short chunks keep small tiles (more programs for the SMs); a long chunk is compute-bound and
# wants larger ones. One H100, Qwen3-0.6B: 4,096 tokens fastest in SHORT_LAUNCH (0.241 ms);
# 8,192 after 8k / 24k tokens 2.48 -> 2.04 / 5.60 -> 4.40 ms in LONG_LAUNCH against 128x64
# tiles (bench/RESULTS.md "Long contexts").
SHORT_LAUNCH = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
LONG_LAUNCH = dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3)
LONG_FROM_TOKENS = 8192


def choose_launch(num_tokens: int) -> dict:
    return LONG_LAUNCH if num_tokens >= LONG_FROM_TOKENS else SHORT_LAUNCH


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row, tile_start, kv_hi, pos, m_i, l_i, acc, d,
                 d_mask, kvh, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_N: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr):
    """One K/V tile into the running softmax. MASKED: the tile crosses the causal diagonal or
    the range's end (bounds and causal mask applied); else every row sees all of it."""
    t = tile_start + tl.arange(0, BLOCK_N)
    if MASKED:
        block = tl.load(bt_row + t // PAGE_SIZE, mask=t < kv_hi, other=0).to(tl.int64)
        kv_mask = (t < kv_hi)[:, None] & d_mask[None, :]
    else:
        block = tl.load(bt_row + t // PAGE_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    kv_off = block * stride_cb + (t % PAGE_SIZE) * stride_cs + kvh * stride_ch
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where((t < kv_hi)[None, :] & (t[None, :] <= pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row can see no key of this split yet (split path): keep it at exp2(-inf) = 0, not NaN
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=varying(
    "block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr", "num_splits", "stride_bt"))
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_q_heads, num_splits,
    stride_qn, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_on, stride_oh,
    GROUP: tl.constexpr, Q_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_first = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_first
    q0 = tile * Q_PER_TILE
    if q0 >= q_len:
        return
    ctx = tl.load(context_lens_ptr + b)

    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // GROUP  # query index within the chunk
    heads = kvh * GROUP + r % GROUP
    row_mask = (r < Q_PER_TILE * GROUP) & (qi < q_len)
    pos = ctx - q_len + qi  # absolute position: the last key this row may see
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tok = (q_first + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # causal: nothing past the tile's last query is needed
    kv_end = tl.minimum(ctx, ctx - q_len + tl.minimum(q0 + Q_PER_TILE, q_len))
    if SPLIT:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits)
        kv_lo = split * tiles_per_split * BLOCK_N
        kv_hi = tl.minimum(kv_lo + tiles_per_split * BLOCK_N, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    # keys every row of the tile sees (up to its first query's position) need no mask: most of
    # a long prompt's tiles. Only the tiles on the causal diagonal pay for the mask.
    first_pos = ctx - q_len + q0
    open_hi = tl.maximum(tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, kv_hi), kv_lo)
    for tile_start in range(kv_lo, open_hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, bt_row, tile_start, kv_hi, pos, m_i, l_i, acc, d,
            d_mask, kvh, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_N, PAGE_SIZE, DOT_PREC, False)
    for tile_start in range(open_hi, kv_hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, bt_row, tile_start, kv_hi, pos, m_i, l_i, acc, d,
            d_mask, kvh, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_N, PAGE_SIZE, DOT_PREC, True)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # workspace [Nq, Hq, S, D] and [Nq, Hq, S], contiguous
        row = (tok * num_q_heads + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=row_mask)
    else:
        tl.store(out_ptr + tok[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)


def choose_num_splits(num_programs: int, num_tokens: int, max_context: int, device: torch.device) -> int:
    """Split the KV range only when the grid would leave most SMs idle and the prefix is long."""
    if num_tokens > SPLIT_MAX_TOKENS or num_programs >= num_sms(device):
        return 1
    return max(1, min(triton.cdiv(num_sms(device), num_programs), MAX_SPLITS, max_context // 256))


def paged_prefill_attention(
    q: torch.Tensor,             # [Nq, Hq, D], sequences packed back to back
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, KV length including this chunk
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    max_seqlen_q: int,
    num_splits: int | None = None,  # None: chosen from shapes (tests force a value)
    pdl: bool = True,               # the split merge launches with PDL where the GPU has it
    launch: dict | None = None,     # None: choose_launch's; else BLOCK_M, BLOCK_N, warps, stages
) -> torch.Tensor:               # [Nq, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    check_paged_inputs("paged_prefill_attention", q, k_cache, v_cache)
    out = torch.empty_like(q)
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    group = num_q_heads // num_kv_heads
    cfg = launch or choose_launch(num_tokens)
    block_m = max(cfg["BLOCK_M"], triton.next_power_of_2(group))
    q_per_tile = block_m // group
    q_tiles = triton.cdiv(max_seqlen_q, q_per_tile)
    if num_splits is None:
        num_splits = choose_num_splits(q_tiles * batch * num_kv_heads, num_tokens,
                                       block_tables.shape[1] * page_size, q.device)
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _prefill_kernel[(q_tiles, batch, num_kv_heads * num_splits)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_out, part_lse,
        scale * math.log2(math.e), num_q_heads, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, Q_PER_TILE=q_per_tile, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE_SIZE=page_size,
        SPLIT=split, DOT_PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split:
        combine_splits(part_out, part_lse, out, pdl)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_seqlen_q: int,
) -> torch.Tensor:
    """Torch reference (and the CPU path): per sequence, gather its context and run masked SDPA."""
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    ctxs = context_lens.tolist()
    for b, ctx in enumerate(ctxs):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        k = gather_context(k_cache, block_tables[b:b + 1], ctx)[0].transpose(0, 1).float()
        v = gather_context(v_cache, block_tables[b:b + 1], ctx)[0].transpose(0, 1).float()
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1).float(), k, v, attn_mask=causal, scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )  # [Hq, q_len, D]
        out[lo:hi] = o.transpose(0, 1)
    return out
